"""Tests of the checkpoint layer and `sexpgpu checkpoint`."""
