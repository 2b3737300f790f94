"""End-to-end failure paths: bad input and failures during a run, through `sexpgpu`."""
