"""An outside LoRA adapter loader, written from docs/plugins.md's loader
contract alone: ``example-npz`` reads an adapter stored as one numpy
``adapter.npz`` (arrays ``<layer>.<module>.A`` [r, in] and ``.B`` [out, r])
beside an ``adapter.json`` with ``rank`` and ``scale``: the kind of format a
team's own training code writes. It imports numpy and fdx.core only."""
from __future__ import annotations

import json
import os

import numpy as np

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import LoRALoader
from fdx.core.lora import LoRAWeights


class NpzLoader(LoRALoader):
    name = "example-npz"

    def load(self, path: str) -> LoRAWeights:
        for f in ("adapter.json", "adapter.npz"):
            if not os.path.isfile(os.path.join(path, f)):
                raise ValueError(f"LoRA adapter {path}: {f} is missing")
        with open(os.path.join(path, "adapter.json")) as f:
            meta = json.load(f)
        arrays = np.load(os.path.join(path, "adapter.npz"))
        modules = {}
        for key in arrays.files:
            layer, module, half = key.split(".")
            if half == "A":
                modules[(int(layer), module)] = (arrays[key], arrays[f"{layer}.{module}.B"])
        return LoRAWeights(rank=int(meta["rank"]), scale=float(meta["scale"]), modules=modules, source=path)


def save_npz(path: str, rank: int, scale: float, modules: dict) -> None:
    """Write ``modules`` {(layer, module): (A, B)} in this format (for tests)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter.json"), "w") as f:
        json.dump({"rank": rank, "scale": scale}, f)
    np.savez(os.path.join(path, "adapter.npz"),
             **{f"{layer}.{m}.{h}": t for (layer, m), ab in modules.items() for h, t in zip("AB", ab)})


@hookimpl
def fdx_register_lora_loaders(register):
    register("example-npz", NpzLoader)
