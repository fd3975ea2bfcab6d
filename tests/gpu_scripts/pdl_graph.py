"""Device script: what a CUDA graph captured from PDL launches holds. Captures two calls of one
decode layer (the Gluon kernel + the combine launch each) under ``KernelConfig(pdl=...)`` with the
graph's debug mode on, writes its DOT dump under OUT_DIR and prints the kernel nodes and edges the
dump names (a programmatic edge is how capture keeps a PDL launch's early start), then replays it
NaN-poisoned and compares with an eager call.

    PYTHONPATH=. python tests/gpu_scripts/pdl_graph.py OUT_DIR [--cfg h64-c4a512] [--batch 2]
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import torch

from dsv4_attn import SparseMLA, bench
from dsv4_attn.common.registry import register_backend
from dsv4_attn.portable.kernels import ops
from dsv4_attn.portable.triton_backend import TritonBackend


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--cfg", default="h64-c4a512")
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    dev = torch.device("cuda")
    case = bench.make_decode_case(bench.DECODE_CONFIGS[args.cfg], args.batch, 1, dev, seed=5)
    for pdl in (0, 2):
        name = f"triton-pdl{pdl}"
        register_backend(name, TritonBackend(ops.KernelConfig(impl="gluon", pdl=pdl)))
        mla = SparseMLA(case.spec, case.fmt, backend=name, max_tokens=case.q.shape[0])
        plan = mla.plan(case.batch)
        outs = [torch.empty_like(case.q) for _ in range(2)]

        def run():
            for out in outs:
                mla.forward(plan, case.kind, case.q, case.swa_cache, case.comp_cache, topk=case.topk, sink=case.sink,
                            out=out)

        run()
        torch.cuda.synchronize()
        want = outs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        graph.enable_debug_mode()
        with torch.cuda.graph(graph):
            run()
        path = pathlib.Path(args.out_dir) / f"graph_pdl{pdl}.dot"
        graph.debug_dump(str(path))
        text = path.read_text()
        kernels = re.findall(r'(\w+)\s*\[[^\]]*shape="?record"?[^\]]*label="[^"]*?(sparse_mla\w*|combine_kernel)', text)
        edges = [line.strip() for line in text.splitlines() if "->" in line]
        flagged = [e for e in edges if re.search(r"program|PROGRAM|port|type", e)]
        print(f"pdl={pdl}: {len(kernels)} kernel nodes named, {len(edges)} edges, {len(flagged)} with a type/port: "
              f"{flagged[:6]}")
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        print(f"pdl={pdl}: replay == eager: {all(torch.equal(out, want) for out in outs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
