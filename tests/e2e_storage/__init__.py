"""End-to-end tests of checkpoints in buckets: `sexpgpu` in subprocesses against moto's S3
server and the GCS emulator on 127.0.0.1."""
