"""GPU probe for the 8-bit KV store: where Triton's compiled kernel and torch's reference differ.

Prints (1) what compiled Triton makes of -x for x = +0, -0 and 1, and (2) for each
(cache dtype, input dtype, shape) of tests/kernels/test_kv_quant.py, how many code or scale
bytes of store_quantized_kv_cache differ from the reference, with the first few. Needs a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nori.kernels import store_quantized_kv_cache, store_quantized_kv_cache_reference


@triton.jit
def _negate(x_ptr, out_ptr, N: tl.constexpr) -> None:
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, -tl.load(x_ptr + offsets))


def negation() -> None:
    x = torch.tensor([0.0, -0.0, 1.0, 0.0], device="cuda")
    out = torch.empty_like(x)
    _negate[(1,)](x, out, N=4)
    print(
        "compiled -x of",
        x.cpu().view(torch.int32).tolist(),
        "->",
        out.cpu().view(torch.int32).tolist(),
    )


def store_mismatches() -> None:
    for cache_dtype in (torch.int8, torch.float8_e4m3fn):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for heads, head_dim in ((1, 8), (2, 16), (3, 80)):
                g = torch.Generator().manual_seed(0)
                fused = torch.randn(13, 3 * heads, head_dim, generator=g)
                fused *= torch.rand(13, 3 * heads, 1, generator=g) * 8
                fused = fused.to(dtype).cuda()
                key, value = fused[:, heads : 2 * heads], fused[:, 2 * heads :]
                key[1, 0] = 0
                value[2, -1, ::2] = -0.0
                shape = (16, 1, heads, head_dim)
                caches = [torch.zeros(shape, dtype=cache_dtype, device="cuda") for _ in range(2)]
                scales = [
                    torch.zeros(shape[:3], dtype=torch.float16, device="cuda") for _ in range(2)
                ]
                slots = torch.arange(13, device="cuda")
                got = [t.clone() for t in caches + scales]
                want = [t.clone() for t in caches + scales]
                store_quantized_kv_cache(
                    key, value, got[0], got[1], got[2], got[3], slots, use_triton=True
                )
                store_quantized_kv_cache_reference(
                    key, value, want[0], want[1], want[2], want[3], slots
                )
                for name, a, b, rows in zip(
                    ("k", "v", "k_scale", "v_scale"),
                    got,
                    want,
                    (key, value, key, value),
                    strict=True,
                ):
                    a8 = a.view(torch.int8) if a.element_size() == 1 else a.view(torch.int16)
                    b8 = b.view(torch.int8) if b.element_size() == 1 else b.view(torch.int16)
                    bad = (a8 != b8).nonzero().tolist()
                    if bad:
                        first = bad[:4]
                        detail = [
                            (
                                i,
                                float(rows[i[0], i[2], i[3]]) if len(i) == 4 else None,
                                int(a8[tuple(i)]),
                                int(b8[tuple(i)]),
                            )
                            for i in first
                        ]
                        print(
                            f"{cache_dtype} {dtype} H={heads} D={head_dim} {name}: {len(bad)} differ; "
                            f"(index, x, triton, reference) {detail}"
                        )
    print("store probe done")


if __name__ == "__main__":
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    negation()
    store_mismatches()
