"""A throwaway plugin for the language tests: data sources and optimizers with the
names, options and fields the real plugins promise, so the compiler can be tested
whether or not those plugins have landed. Registered as ``zz-lang-fake`` so a real
plugin of the same name is found first."""

from sexpgpu.extension import DataSourceInfo, OptimizerInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ir import TensorType


def _tokens(options, seq, batch):
    return {"inputs": TensorType((batch, seq), "i64"), "targets": TensorType((batch, seq), "i64")}


def _shapes(options, seq, batch):
    size = options["size"]
    return {
        "inputs": TensorType((batch, 1, size, size), "f32"),
        "targets": TensorType((batch,), "i64"),
    }


def _vectors(options, seq, batch):
    if options["width"] < 1:
        raise ValueError(":width must be at least 1")
    w = options["width"]
    return {"inputs": TensorType((batch, w), "f32"), "targets": TensorType((batch, w), "f32")}


def _never(*args):
    raise AssertionError("the language tests never open data")


@hookimpl
def sexpgpu_data_sources():
    return [
        DataSourceInfo("arithmetic", {"digits": 3, "split": "train"}, _tokens, _never),
        DataSourceInfo("sort", {"vocab": 16, "length": 0, "split": "train"}, _tokens, _never),
        DataSourceInfo("copy", {"vocab": 16, "length": 0, "split": "train"}, _tokens, _never),
        DataSourceInfo("shapes", {"classes": 4, "size": 16, "split": "train"}, _shapes, _never),
        DataSourceInfo("vectors", {"width": 4, "scale": 1.0}, _vectors, _never),
    ]


@hookimpl
def sexpgpu_optimizers():
    return [
        OptimizerInfo(
            "sgd",
            {"lr": None, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False},
            lambda o: ("m",) if o["momentum"] else (),
            _never,
        ),
        OptimizerInfo(
            "adam",
            {"lr": None, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
            lambda o: ("m", "v"),
            _never,
        ),
        OptimizerInfo(
            "adamw",
            {
                "lr": None,
                "beta1": 0.9,
                "beta2": 0.999,
                "eps": 1e-8,
                "weight_decay": 0.01,
                "no_decay_tags": ("no-decay",),
            },
            lambda o: ("m", "v"),
            _never,
        ),
    ]
