"""The H200 step-cost table at large batches, measured as the shared one was.

    python -m evals gpu-step-costs [--out DIR] [--toy] [--print-command]

One forward step of a Qwen2.5-7B- and a 1.5B-shaped decoder (bf16, 28
layers, each step one CUDA graph, the median of 20 replays timed with CUDA
events): every weight matmul, the LM head included, for B rows of q query
tokens, B in 64, 128, 256, 512 and q in 1, 2, 3, 5, 9, 17. Attention is
modelled as the KV-cache read of a 1,024-token context at 4.3 TB/s, as the
shared table (``../shared/data/costs``) models it. Writes
``step_costs.jsonl`` in ``--out`` (default ``$OUT`` or ``results/``), one
line per (model, B, q) in the shared table's format, and prints each.

B 64 and 128 check the shared table; 256 and 512 extend it
(``evals/replay/h200_large_batches.jsonl`` is this command's output at
those sizes). PyTorch only, no import from this repository:
``--print-command`` prints a shell command that runs this file's
:func:`measure` on a GPU machine that has no copy of the repository.
``--toy``: tiny shapes on the CPU (the script runs; nothing is measured).
"""

import argparse
import inspect
import os
import sys


def measure():  # self-contained: --print-command sends this function's body alone
    import torch, json, os, statistics as S  # noqa: E401
    T = os.environ.get('TOY')
    d = torch.device('cpu' if T else 'cuda')
    bf = torch.float32 if T else torch.bfloat16
    M = {'toy': (64, 96, 128, 512, 2)} if T else {
        'qwen2.5-7b': (3584, 4608, 18944, 152064, 4), 'qwen2.5-1.5b': (1536, 2048, 8960, 151936, 2)}
    f = open(os.environ.get('OUT', '.') + '/step_costs.jsonl', 'w')
    nm = 'cpu' if T else torch.cuda.get_device_name(0)
    with torch.inference_mode():
        for m, (h, qkv, I, V, kv) in M.items():  # hidden, q+k+v, intermediate, vocab, KV heads
            w = lambda a, b: torch.randn(a, b, device=d, dtype=bf) * .01  # noqa: E731
            L = [(w(h, qkv), w(h, h), w(h, 2 * I), w(I, h)) for _ in range(28)]
            H = w(h, V)
            for B in (64, 128, 256, 512):
                for q in (1, 2, 3, 5, 9, 17):
                    x = torch.randn(B * q, h, device=d, dtype=bf)

                    def st():
                        y = x
                        for a, o, g, dn in L:
                            y.matmul(a)
                            y = y.matmul(o)
                            y = y.matmul(g)[:, :I].matmul(dn)
                        return y.matmul(H)
                    if T:
                        import time
                        ts = []
                        t = time.perf_counter()
                        st()
                        ts.append((time.perf_counter() - t) * 1e3)
                    else:
                        st()
                        st()
                        gr = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(gr):
                            st()
                        gr.replay()
                        ts = []
                        for _ in range(20):
                            a = torch.cuda.Event(enable_timing=True)
                            b = torch.cuda.Event(enable_timing=True)
                            a.record()
                            gr.replay()
                            b.record()
                            b.synchronize()
                            ts.append(a.elapsed_time(b))
                        del gr
                    g = S.median(ts)
                    at = B * 1024 * 28 * 2 * kv * 128 * 2 / 4.3e12 * 1e3  # K and V, bf16, 4.3 TB/s
                    r = dict(model=m, B=B, q=q, L=1024, gemm_ms=round(g, 4), attn_model_ms=round(at, 4),
                             ms=round(g + at, 4), device=nm, torch=torch.__version__,
                             spread_ms=[round(min(ts), 4), round(max(ts), 4)],
                             source='consensus_spec issue 50, measured')
                    f.write(json.dumps(r) + '\n')
                    f.flush()
                    print(json.dumps(r), flush=True)
            del L, H


def device_command() -> str:
    """``python3 -c`` of :func:`measure`'s body, compressed (a command line
    is limited: 2,000 characters on this project's GPU machines)."""
    import base64
    import textwrap
    import zlib
    body = textwrap.dedent(inspect.getsource(measure).split("\n", 1)[1])
    blob = base64.b85encode(zlib.compress(body.encode(), 9)).decode()
    return ("PYTHONUNBUFFERED=1 python3 -c 'import base64 as b,zlib;"
            f"exec(zlib.decompress(b.b85decode(\"{blob}\")))'")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals gpu-step-costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results")
    ap.add_argument("--toy", action="store_true", help="tiny shapes on the CPU: nothing is measured")
    ap.add_argument("--print-command", action="store_true",
                    help="print the command that runs the measurement where this repository is not")
    args = ap.parse_args(argv)
    if args.print_command:
        print(device_command())
        return 0
    import torch
    if not args.toy and not torch.cuda.is_available():
        print("error: no CUDA device (use --toy on a CPU)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    os.environ["OUT"] = args.out
    if args.toy:
        os.environ["TOY"] = "1"
    measure()
    return 0
