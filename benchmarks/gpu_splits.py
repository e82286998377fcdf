"""Decode attention split counts on a GPU: each shape's default against fixed ``num_splits`` (L2 cold, graph replay).

    python benchmarks/gpu_splits.py

Prints, per shape, every variant's median in µs, fastest first. The default split rule in
``kernels/decode_attention.py`` (``choose_num_splits``) quotes this script's H200 numbers.
"""

from functools import partial

import torch

from sparse_ref.bench import Timer, dense_attention_inputs
from sparse_ref.kernels.decode_attention import choose_num_splits, paged_decode_attention

SHAPES = ((1, 32, 32, 32768), (1, 32, 32, 2048), (1, 32, 32, 131072), (64, 32, 8, 32768), (64, 32, 8, 2048),
          (8, 32, 8, 32768))  # (bs, q heads, KV heads, context)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_splits.py times a CUDA GPU; there is none here.")
    dev = torch.device("cuda")
    timer = Timer(dev, reps=60)
    for bs, hq, hkv, ctx in SHAPES:
        q, k, v, table, kv_lens = dense_attention_inputs(bs, hq, hkv, 128, ctx, 16, torch.bfloat16, dev)
        out = torch.empty(q.shape, dtype=torch.float32, device=dev)
        res = {}
        for ns in (None, 1, 2, 3, 4, 6, 8, 16, 17, 33):
            kw = {} if ns is None else {"num_splits": ns}
            res[str(kw)] = timer.cold([partial(paged_decode_attention, q, k, v, table, kv_lens, 16, out=out, **kw)])
        default = choose_num_splits(bs, hkv, ctx, 64 if hq > hkv else 32, dev)
        print(f"bs={bs} hkv={hkv} ctx={ctx} default splits={default}:",
              ", ".join(f"{k} {v:.1f}" for k, v in sorted(res.items(), key=lambda x: x[1])), flush=True)
        del q, k, v, table, kv_lens, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
