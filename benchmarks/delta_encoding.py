"""Which delta encoding, measured here (issue 24's first step: "decide the encoding from
measurements"). Usage: ``python benchmarks/delta_encoding.py [--lr 1e-6 3e-6] [--steps 10]``
(needs ``pip install zstandard xxhash``).

The example Llama (examples/llama.py, one process) is trained with AdamW on random next-token
batches, fp32 master weights, and every step's bf16 cast is what a trainer would ship. Between two
consecutive bf16 versions, per step: the fraction of elements that changed, and for the whole
model as one flat bf16 buffer (cut into buckets of ``--bucket-mb``) the bytes and the encode and
decode speeds (GB/s of the full buffer, one core) of:

* ``idx+val``: the int32 indices of the changed elements and their new bf16 values (6 B each);
* ``mask+val``: a bitmask of the changed elements (1 bit each) and their new values;
* ``xor+zstd1`` / ``xor+zstd3``: the XOR of the two versions' 16-bit words, zstd level 1 / 3;
* ``xor-split+zstd1``: the same with the high and the low bytes of the words split apart first;
* checksums over the new buffer: xxh3-64 and zlib's crc32 (GB/s).

Prints one JSON line per step and learning rate, and a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import llama  # noqa: E402

CONFIG = llama.LlamaConfig(
    vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=6, num_heads=8, num_kv_heads=4
)


def build(seed: int) -> llama.Llama:
    torch.manual_seed(seed)
    model = llama.Llama(CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


def flat_bf16(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().to(torch.bfloat16).reshape(-1) for p in model.parameters()])


def timed(fn, repeat: int = 3):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def encodings(old: torch.Tensor, new: torch.Tensor, bucket: int) -> dict:
    import xxhash
    import zstandard

    full = new.numel() * 2
    words_old, words_new = old.view(torch.int16), new.view(torch.int16)
    out = {}

    def per_bucket(encode, decode):
        size, enc_s, dec_s = 0, 0.0, 0.0
        for start in range(0, new.numel(), bucket):
            o, n = words_old[start : start + bucket], words_new[start : start + bucket]
            blob, s = timed(lambda o=o, n=n: encode(o, n))
            enc_s += s
            size += blob if isinstance(blob, int) else len(blob)
            if decode is not None:
                back, s = timed(lambda o=o, blob=blob: decode(o, blob))
                dec_s += s
                assert torch.equal(back, n), "decoding is not exact"
        return {"bytes": size, "fraction_of_full": size / full, "encode_gbps": full / enc_s / 1e9} | (
            {"decode_gbps": full / dec_s / 1e9} if decode is not None else {}
        )

    def idx_val(o, n):
        idx = (o != n).nonzero().view(-1).to(torch.int32)
        return idx.numpy().tobytes() + n[idx.long()].numpy().tobytes()

    def idx_val_decode(o, blob):
        k = len(blob) // 6
        idx = torch.frombuffer(bytearray(blob[: 4 * k]), dtype=torch.int32).long()
        vals = torch.frombuffer(bytearray(blob[4 * k :]), dtype=torch.int16)
        back = o.clone()
        back[idx] = vals
        return back

    def mask_val(o, n):
        changed = o != n
        import numpy as np

        return np.packbits(changed.numpy()).tobytes() + n[changed].numpy().tobytes()

    def mask_val_decode(o, blob):
        import numpy as np

        m = (o.numel() + 7) // 8
        changed = torch.from_numpy(np.unpackbits(np.frombuffer(blob[:m], dtype=np.uint8))[: o.numel()].astype(bool))
        back = o.clone()
        back[changed] = torch.frombuffer(bytearray(blob[m:]), dtype=torch.int16)
        return back

    def xor_zstd(level: int, split: bool):
        cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()

        def enc(o, n):
            x = torch.bitwise_xor(o, n)
            raw = x.view(torch.uint8).view(-1, 2).t().contiguous() if split else x
            return cctx.compress(raw.numpy().tobytes())

        def dec(o, blob):
            raw = torch.frombuffer(bytearray(dctx.decompress(blob)), dtype=torch.uint8)
            x = raw.view(2, -1).t().contiguous().view(torch.int16).view(-1) if split else raw.view(torch.int16)
            return torch.bitwise_xor(o, x)

        return enc, dec

    out["idx+val"] = per_bucket(idx_val, idx_val_decode)
    out["mask+val"] = per_bucket(mask_val, mask_val_decode)
    out["xor+zstd1"] = per_bucket(*xor_zstd(1, False))
    out["xor+zstd3"] = per_bucket(*xor_zstd(3, False))
    out["xor-split+zstd1"] = per_bucket(*xor_zstd(1, True))
    raw = new.view(torch.uint8).numpy()
    _, s = timed(lambda: xxhash.xxh3_64_intdigest(raw))
    out["xxh3_gbps"] = full / s / 1e9
    _, s = timed(lambda: zlib.crc32(raw))
    out["crc32_gbps"] = full / s / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bucket = int(args.bucket_mb * (1 << 20)) // 2
    summary = {}
    for lr in args.lr:
        model = build(0)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        g = torch.Generator().manual_seed(1)
        previous = flat_bf16(model)
        print(f"# lr {lr}: {previous.numel() / 1e6:.1f} M parameters, {previous.numel() * 2 / 1e6:.1f} MB in bf16")
        rows = []
        for step in range(1, args.steps + 1):
            tokens = torch.randint(0, CONFIG.vocab_size, (4, 65), generator=g)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            current = flat_bf16(model)
            changed = float((current.view(torch.int16) != previous.view(torch.int16)).float().mean())
            row = {"lr": lr, "step": step, "changed_fraction": changed, **encodings(previous, current, bucket)}
            print(json.dumps(row))
            rows.append(row)
            previous = current
        summary[lr] = rows
    print("\n| lr | changed (median of steps) | " + " | ".join(ENCODINGS) + " | xxh3 GB/s | crc32 GB/s |")
    print("|---" * (len(ENCODINGS) + 4) + "|")
    for lr, rows in summary.items():

        def med(f):
            values = sorted(f(r) for r in rows)
            return values[len(values) // 2]

        cells = [
            f"{100 * med(lambda r, e=e: r[e]['fraction_of_full']):.2f}% of full, enc "
            f"{med(lambda r, e=e: r[e]['encode_gbps']):.2f} / dec {med(lambda r, e=e: r[e]['decode_gbps']):.2f} GB/s"
            for e in ENCODINGS
        ]
        print(
            f"| {lr:g} | {100 * med(lambda r: r['changed_fraction']):.2f}% | "
            + " | ".join(cells)
            + f" | {med(lambda r: r['xxh3_gbps']):.1f} | {med(lambda r: r['crc32_gbps']):.1f} |"
        )


ENCODINGS = ("idx+val", "mask+val", "xor+zstd1", "xor+zstd3", "xor-split+zstd1")

if __name__ == "__main__":
    main()
