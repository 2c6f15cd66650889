"""What MLX's CUDA graphs hold during decode steps, per KV scheme (GPU machine).

MLX records each evaluation's kernels into CUDA graphs of at most
``MLX_MAX_OPS_PER_BUFFER`` nodes and keeps each graph's executable under a key
made of its nodes' dependency edges and counts: a step whose graphs have the
keys of an earlier step's updates those executables, a new key instantiates
one. With ``MLX_SAVE_CUDA_GRAPHS_DOT_FILE`` MLX writes every committed graph
as a DOT file; this script sets it, runs the schemes' ``generate_step``s as
``generate_interleaved.py`` does (prefilled, then ``--steps`` decode steps
each, in turns) and reads back, per decode step: the graphs committed, their
nodes (kernels, captured child graphs, empty nodes) and edges, the kernels by
name, and how many of the step's graph keys (edges and counts, as MLX forms
them) no earlier decode step of any scheme had.

    python3 scripts/gpu/cuda_graph_dots.py --context 32768 --schemes 4 codebook-3 \\
        --out $OUT/graph-dots.json
"""

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import tempfile

NODE = re.compile(r'"?(graph_(\d+)_node_(\d+))"?\s*\[([^\]]*)\]', re.DOTALL)
EDGE = re.compile(r'"?graph_(\d+)_node_(\d+)"?\s*->\s*"?graph_(\d+)_node_(\d+)"?')
KERNEL = re.compile(r"(custom_kernel_\w+|_Z\w+|\bvoid\s+[\w:<>, ]+?\()")


def node_kind(attributes):
    """'K' kernel, 'G' child graph, 'E' empty, '?' else, from a DOT node's
    attributes as cudaGraphDebugDotPrint writes them."""
    text = attributes.upper()
    if "KERNEL" in text:
        return "K"
    if "CHILD" in text or "GRAPH_" in text:
        return "G"
    if "EMPTY" in text:
        return "E"
    return "?"


def kernel_names(attributes):
    """The kernel names a node's label holds, shortened."""
    names = []
    for match in KERNEL.findall(attributes):
        name = match.strip()
        names.append(name[:80])
    return names[:1]


def read_graph(path):
    """One committed graph: the top-level graph's nodes and edges (the lowest
    graph number in the file), its key and its kernels."""
    with open(path) as f:
        text = f.read()
    nodes = {}
    top = None
    for name, graph, index, attributes in NODE.findall(text):
        graph, index = int(graph), int(index)
        top = graph if top is None else min(top, graph)
        nodes[(graph, index)] = attributes
    top_nodes = {i: a for (g, i), a in nodes.items() if g == top}
    edges = sorted(
        (int(a), int(b))
        for ga, a, gb, b in EDGE.findall(text)
        if int(ga) == top and int(gb) == top
    )
    order = sorted(top_nodes)
    names = {i: kernel_names(top_nodes[i]) for i in order}
    kinds = "".join("K" if names[i] else node_kind(top_nodes[i]) for i in order)
    kernels = [name for i in order for name in names[i]]
    key = f"{kinds}|" + ",".join(f"{a}-{b}" for a, b in edges)
    return {
        "nodes": len(top_nodes),
        "kinds": kinds,
        "edges": len(edges),
        "key": key,
        "kernels": kernels,
        "bytes": len(text),
    }


def dumps(folder):
    """The DOT files written so far, in commit order."""
    numbered = []
    for name in os.listdir(folder):
        found = re.findall(r"(\d+)", name)
        if name.endswith(".dot") and found:
            numbered.append((int(found[-1]), name))
    return [os.path.join(folder, name) for _, name in sorted(numbered)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--schemes", nargs="+", default=["4", "codebook-3"])
    parser.add_argument("--steps", type=int, default=12, help="decode steps a turn")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--keep", type=int, default=2, help="steps' DOT files kept")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="graph-dots-")
    os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = os.path.join(folder, "g")
    import mlx.core as mx
    from generate_interleaved import start

    from omlx_cache import bench

    preset = bench.PRESETS[opts.preset]
    model = bench.build_model(preset, getattr(mx, preset.get("dtype", "float16")))
    vocab = model.args.vocab_size
    tokens = opts.turns * opts.steps + 4
    generators = [start(model, n, opts.context, tokens, vocab)[0] for n in opts.schemes]
    for steps in generators:  # the step in flight when a turn starts
        next(steps)
    seen_keys = set()
    per_scheme = collections.defaultdict(list)
    kept_dir = os.path.join(os.path.dirname(os.path.abspath(opts.out)), "dots")
    os.makedirs(kept_dir, exist_ok=True)
    done = len(dumps(folder))
    for turn in range(opts.turns):
        for name, steps in zip(opts.schemes, generators):
            for step in range(opts.steps):
                next(steps)
                mx.synchronize()
                files = dumps(folder)
                graphs = [read_graph(p) for p in files[done:]]
                if turn == opts.turns - 1 and step < opts.keep:
                    target = os.path.join(kept_dir, f"{name.replace('/', '_')}-{step}")
                    os.makedirs(target, exist_ok=True)
                    for p in files[done:]:
                        shutil.copy(p, target)
                for p in files[done:]:
                    os.remove(p)
                done = len(dumps(folder))
                keys = [g["key"] for g in graphs]
                new = sum(k not in seen_keys for k in keys)
                seen_keys.update(keys)
                per_scheme[name].append(
                    {
                        "turn": turn,
                        "graphs": len(graphs),
                        "nodes": sum(g["nodes"] for g in graphs),
                        "kinds": collections.Counter(
                            "".join(g["kinds"] for g in graphs)
                        ),
                        "edges": sum(g["edges"] for g in graphs),
                        "new_keys": new,
                        "distinct_keys": len(set(keys)),
                        "kernels": collections.Counter(
                            k for g in graphs for k in g["kernels"]
                        ),
                        "graph_nodes": [g["nodes"] for g in graphs],
                        "keys_hash": hash(tuple(keys)),
                    }
                )
    report = {"context": opts.context, "schemes": {}}
    for name, rows in per_scheme.items():
        later = [r for r in rows if r["turn"] > 0]
        summary = {
            "graphs_median": statistics.median(r["graphs"] for r in later),
            "nodes_median": statistics.median(r["nodes"] for r in later),
            "edges_median": statistics.median(r["edges"] for r in later),
            "new_keys_after_first_turn": sum(r["new_keys"] for r in later),
            "distinct_step_key_sequences": len({r["keys_hash"] for r in later}),
            "kernels_last_step": dict(rows[-1]["kernels"].most_common()),
            "kinds_last_step": dict(rows[-1]["kinds"]),
            "graph_nodes_last_step": rows[-1]["graph_nodes"],
            "steps": [
                {k: v for k, v in r.items() if k not in ("kernels", "keys_hash")}
                for r in rows
            ],
        }
        report["schemes"][name] = summary
        print(
            f"{name:<14} graphs/step {summary['graphs_median']}, nodes "
            f"{summary['nodes_median']}, edges {summary['edges_median']}, new keys "
            f"after turn 1: {summary['new_keys_after_first_turn']}, distinct step "
            f"key sequences {summary['distinct_step_key_sequences']} of {len(later)}",
            flush=True,
        )
    with open(opts.out, "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
