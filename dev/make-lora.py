#!/usr/bin/env python3
"""Write a small LoRA adapter (GGUF) for the test model: dev/make-lora.py BASE.gguf OUT.gguf

Run by dev/llama-server.sh (start-fim) with the cache's gguf venv (numpy) and the llama.cpp sdist's
gguf-py on PYTHONPATH. Rank 4 on every block's attn_q.weight; the values come from numpy's generator
with a fixed seed, so the file is the same bytes every time. The shapes are read from BASE: for a base
tensor of ggml shape [n_in, n_out], lora_a has numpy shape (rank, n_in) and lora_b (n_out, rank)
(numpy shapes are ggml's reversed). alpha = rank: at scale 1.0 the update is lora_b @ lora_a itself.
Its values (scale 0.5) are large enough that at temperature 0 the text with the adapter at scale 1.0
differs from the text without it; at scale 0.0 the model is unchanged.
"""

import re
import sys

import gguf
import numpy as np

RANK = 4
SEED = 20261201
SCALE = 0.5
TARGET = re.compile(r"^blk\.\d+\.attn_q\.weight$")


def main(base_path, out_path):
    reader = gguf.GGUFReader(base_path)
    arch = reader.fields["general.architecture"]
    arch_name = bytes(arch.parts[arch.data[0]]).decode()
    targets = sorted(
        ((t.name, [int(n) for n in t.shape]) for t in reader.tensors if TARGET.match(t.name)),
        key=lambda item: int(item[0].split(".")[1]),
    )
    if not targets:
        sys.exit("make-lora.py: no tensor named blk.N.attn_q.weight in %s" % base_path)
    rng = np.random.default_rng(SEED)
    writer = gguf.GGUFWriter(out_path, arch_name)
    writer.add_string("general.type", "adapter")
    writer.add_string("general.name", "loopclient test adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(RANK))
    for name, (n_in, n_out) in targets:
        lora_a = (rng.standard_normal((RANK, n_in)) * SCALE).astype(np.float32)
        lora_b = (rng.standard_normal((n_out, RANK)) * SCALE).astype(np.float32)
        writer.add_tensor(name + ".lora_a", lora_a)
        writer.add_tensor(name + ".lora_b", lora_b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(
        "make-lora.py: %d tensor pairs (rank %d, %s) -> %s" % (len(targets), RANK, arch_name, out_path), file=sys.stderr
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n")[0])
    main(sys.argv[1], sys.argv[2])
