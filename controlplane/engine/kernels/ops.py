"""Every op of our C++ CPU library (namespace `controlplane_cpu`): its schema, and beside it
the fake that tells torch.compile its output's shape (for the ops a compiled step traces).

The schemas live here, once; the C++ sources (csrc/) only implement them
(`TORCH_LIBRARY_IMPL`, or a catch-all `m.impl` for the ops with nothing to dispatch on), so a
newcomer reads the whole surface in one file. Importing this module defines the ops and their
fakes; their kernels arrive when cpu_ops loads the built library (the dispatcher accepts
kernels and schemas in either order). Until then a call raises "no kernel", which is why every
caller asks `cpu_ops.available()` first.
"""

from __future__ import annotations

import torch

NAMESPACE = "controlplane_cpu"

# FRAGMENT, not DEF: the namespace is ours alone, and a fragment can be imported again (a
# module reload in a test) without "namespace already defined".
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")

# What each op's kernel is registered under in C++: "CPU" (dispatched on its tensors) or
# "CompositeImplicitAutograd" (a catch-all `m.impl`: no tensor to dispatch on, or only lists).
# cpu_ops checks after loading that every op here got its kernel.
KERNEL_KEYS: dict[str, str] = {}


def _define(schema: str, key: str = "CPU") -> str:
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    KERNEL_KEYS[name] = key
    return f"{NAMESPACE}::{name}"


# -- attention (csrc/cpu_ops.cpp; used by engine/attention/cpu.py) ----------------------------

# One decode step's attention over the paged cache, writing the new K/V first when given.
# Called eagerly only (the compiled step goes through step_attention): no fake.
_define(
    "paged_decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_scale, "
    "Tensor? v_scale, Tensor block_table, Tensor context_lens, int block_size, float sm_scale, "
    "Tensor? k_new=None, Tensor? v_new=None, Tensor? slot_mapping=None, bool bf16_dot=True) "
    "-> Tensor"
)

# The compiled step's metadata, set in C++ before the graph runs and cleared after it, so the
# graph's attention op finds it without Python. Never traced: no fakes.
_define(
    "set_decode_step(Tensor[] k_caches, Tensor[] v_caches, Tensor block_table, "
    "Tensor context_lens, Tensor slot_mapping, int block_size, float sm_scale, "
    "bool bf16_dot=True) -> ()",
    "CompositeImplicitAutograd",
)
_define("clear_decode_step() -> ()", "CompositeImplicitAutograd")


@torch.library.register_fake(
    _define("step_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


# -- int4 weights (csrc/int4_linear.cpp, int4_linear_bf16.cpp; used by model/quant/) --------


@torch.library.register_fake(
    _define(
        "int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, int group_size, "
        "int block_n, bool split) -> Tensor"
    )
)
@torch.library.register_fake(
    _define(
        "int4_linear_bf16(Tensor x, Tensor packed, Tensor scales_and_zeros, int group_size, "
        "int block_n, bool split, bool amx=False) -> Tensor"
    )
)
def _(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    block_n: int,
    split: bool,
    amx: bool = False,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


# What the library was built for and the CPU can run: asked once, eagerly. No fakes.
_define("amx_supported() -> bool", "CompositeImplicitAutograd")
_define("bf16_dot_supported() -> bool", "CompositeImplicitAutograd")


# -- int8 weights, and int8 activations (csrc/int8_linear.cpp, int8_activations.cpp) ---------


@torch.library.register_fake(
    _define("int8_linear(Tensor x, Tensor weight, Tensor? scales) -> Tensor")
)
@torch.library.register_fake(
    _define("int8_linear_bf16(Tensor x, Tensor weight, Tensor? scales) -> Tensor")
)
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake(
    _define("w4a8_linear(Tensor x, Tensor weight, Tensor scales, Tensor mins) -> Tensor")
)
def _(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake(
    _define("w8a8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor")
)
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


# -- packed float and bf16 weights (csrc/packed_linear.cpp, bf16_linear.cpp; model/linear.py)


@torch.library.register_fake(
    _define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
)
@torch.library.register_fake(
    _define("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
)
def _(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


# Packing happens once, when a layer is built (eager): no fakes.
_define("packed_rows(int t) -> int", "CompositeImplicitAutograd")
_define("bf16_pack_weight(Tensor weight) -> Tensor")


def missing_kernels() -> list[str]:
    """The ops defined here whose kernel did not arrive (after the library loaded: none)."""
    return [
        name
        for name, key in KERNEL_KEYS.items()
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", key)
    ]
