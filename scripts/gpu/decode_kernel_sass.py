"""Instructions in one 16-key tile of the codebook decode kernel's main loop.

Wraps ``codebook_kernel``'s decode source in a ``__global__`` function as MLX
does (one page slot, the template arguments as constants), compiles it with
``nvcc -cubin -arch=sm_90`` and reads the SASS with ``cuobjdump -sass`` (both
from the ``nvidia-cuda-nvcc`` and ``nvidia-cuda-cuobjdump`` wheels; no GPU
needed). The main loop is the backward branch whose body holds the most
``HMMA``s; its instructions are counted without the blocks that the
rescaling vote skips (the first branch after a ``VOTE.ANY``: most tiles
skip them) and
divided by the tiles in the body (16 ``HMMA``s a tile at D = 128).

    python3 scripts/gpu/decode_kernel_sass.py --dim 128 --bits 3 3
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from omlx_cache import codebook_kernel as ck
from omlx_cache.codebook_kernel import qd

TYPES = {
    "queries": "__half",
    "k_norms_0": "__half",
    "v_norms_0": "__half",
    "meta": "int32_t",
    "mask": "bool",
    "held_keys": "__half",
    "held_values": "__half",
    "held_count": "int32_t",
    "new_keys": "__half",
    "new_values": "__half",
    "kept_keys": "__half",
    "kept_values": "__half",
    "kept": "int32_t",
    "key_mean": "float",
    "value_mean": "float",
    "key_weights": "float",
}
OUTPUTS = {
    "out_values": "float",
    "out_max": "float",
    "out_sum": "float",
    "out_held_keys": "__half",
    "out_held_values": "__half",
}
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*)")


def kernel_source(dim, heads, key_bits, value_bits, whole, extras=False):
    """The kernel as MLX compiles it: ``codebook_kernel``'s body for one
    template (``quantized_decode.specialized_kernel``) in a ``__global__``
    function."""
    _, inputs, outputs, source = ck._decode_kernel(1, extras)
    params = []
    for name in inputs:
        params.append(f"const {TYPES.get(name, 'uint32_t')}* __restrict__ {name}")
        if f"{name}_shape" in source:
            params.append(f"const int32_t* {name}_shape")
    params += [f"{OUTPUTS[name]}* __restrict__ {name}" for name in outputs]
    flags = bool(extras)
    half = ck.mx.float16
    shape = (dim, heads, key_bits, value_bits, True, True, 8, 0, False)
    template = ck._template(*shape, half, ck.mx.bool_, half)
    template += (("NP", 1), ("INC", True), ("WHOLE", bool(whole)), ("KEPT", flags))
    template += (("SKIP", flags), ("CK", flags), ("CV", flags), ("WK", flags))
    return "\n".join(
        [
            "#include <cuda_fp16.h>",
            "#include <cstdint>",
            ck._header(),
            f'extern "C" __global__ void decode({", ".join(params)}) {{',
            qd._compact(qd._constants(template) + source),
            "}",
        ]
    )


def sass(code):
    """(ptxas's register and spill report, the SASS) of ``code``."""
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        with open(cu, "w") as f:
            f.write(code)
        built = subprocess.run(
            ["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", cubin, cu],
            check=True,
            capture_output=True,
            text=True,
        )
        report = [
            line.strip()
            for line in built.stderr.splitlines()
            if "Used" in line or "spill" in line
        ]
        listing = subprocess.run(
            ["cuobjdump", "-sass", cubin], check=True, capture_output=True, text=True
        )
        return report, listing.stdout


def tile_instructions(text):
    """The main loop's instructions (address, opcode, operands) without the
    blocks the rescaling vote skips, and its ``HMMA`` count."""
    code = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            code.append((int(m.group(1), 16), m.group(3), m.group(4)))

    def target(args):
        found = re.search(r"0x([0-9a-f]+)", args)
        return int(found.group(1), 16) if found else None

    loops = []
    for address, op, args in code:
        start = target(args) if op.startswith("BRA") else None
        if start is not None and start < address:
            body = [c for c in code if start <= c[0] <= address]
            loops.append((sum(op.startswith("HMMA") for _, op, _ in body), body))
    hmmas, body = max(loops, key=lambda loop: loop[0])
    skipped, voted = [], False
    for address, op, args in body:
        voted = voted or op.startswith("VOTE")
        if voted and op.startswith("BRA"):
            skipped.append((address, target(args)))
            voted = False
    kept = [c for c in body if not any(a < c[0] < b for a, b in skipped)]
    return kept, hmmas


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--bits", type=int, nargs=2, default=[3, 3])
    parser.add_argument("--clamped", action="store_true", help="WHOLE = 0")
    parser.add_argument(
        "--extras",
        action="store_true",
        help="the kernel for kept tokens, centering and key weights, all on",
    )
    opts = parser.parse_args()
    code = kernel_source(
        opts.dim, opts.heads, *opts.bits, not opts.clamped, opts.extras
    )
    report, listing = sass(code)
    kept, hmmas = tile_instructions(listing)
    tiles = hmmas // (opts.dim // 8)  # an mma per 16 dims, keys and values
    ops = collections.Counter(op.split(".")[0] for _, op, _ in kept)
    print(
        f"D {opts.dim}, bits {opts.bits}: {len(kept) / tiles:.0f} instructions "
        f"a tile ({tiles} tiles in the loop body)"
    )
    print(*report, sep="\n")
    for op, n in ops.most_common(8):
        print(f"  {op:8s} {n / tiles:6.1f}")


if __name__ == "__main__":
    main()
