from __future__ import annotations

import subprocess
import sys
import textwrap


def test_package_imports_and_runs_references_without_triton() -> None:
    # Blocking `triton` in sys.modules makes every import of it fail, as on a machine without it.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None
        import torch
        import nori.kernels as kernels
        cache = torch.zeros(4, 2, 1, 8)
        key = torch.ones(3, 1, 8)
        kernels.store_kv_cache(key, key, cache, cache.clone(), torch.tensor([0, -1, 5]))
        tables = torch.tensor([[0, 2]], dtype=torch.int32)
        lens = torch.tensor([3], dtype=torch.int32)
        out = kernels.paged_decode_attention(torch.ones(1, 2, 8), cache, cache, tables, lens, 1.0)
        assert out.shape == (1, 2, 8)
        try:
            kernels.paged_decode_attention(
                torch.ones(1, 2, 8), cache, cache, tables, lens, 1.0, use_triton=True
            )
        except ValueError as error:
            assert "triton is not installed" in str(error)
        else:
            raise AssertionError("use_triton=True without triton should fail")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True)
