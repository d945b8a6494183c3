"""`ds4-mlx bench parity`: our logits against transformers' `DeepseekV4ForCausalLM` on the same random
weights, prefill and decode, in the exact mode and with the fast defaults (docs/PRECISION.md).

The parent process builds the transformers model (float32, TF32 off, on CUDA when torch has it), writes
its weights as a GGUF and its logits of every position (causal: they are the reference for our prefill
and our decoded tokens alike), then runs each mode in its own process, since MLX reads its TF32 switch
once per process:
- exact: float32, `quant_sim` off, `MLX_ENABLE_TF32=0`;
- fast: the same weights with MLX's default TF32 products (`MLX_ENABLE_TF32=1`);
- bfloat16: `model.cast(mx.bfloat16)`.
A mode process prefills all but the last `--decode` tokens in the session's 2,048-token chunks, decodes
the rest one token at a time, and compares with the reference.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

MODES = {"exact": {"MLX_ENABLE_TF32": "0"}, "fast": {"MLX_ENABLE_TF32": "1"}, "bfloat16": {}}


def parity_args(a):
    """Real widths (V4 Flash's, with `--ratios` layers and `--experts` routed experts) or the real cache
    geometry at tiny widths."""
    from ds4_mlx.models.args import ModelArgs
    from ds4_mlx.tools.testing import real_geometry_args

    ratios = [int(r) for r in a.ratios.split(",")]
    if a.widths == "tiny":
        return real_geometry_args(num_hidden_layers=len(ratios), compress_ratios=ratios)
    args = ModelArgs(num_hidden_layers=len(ratios), compress_ratios=ratios, num_hash_layers=1, n_routed_experts=a.experts)
    if a.experts < args.num_experts_per_tok:
        raise ValueError(f"--experts {a.experts}: each token takes {args.num_experts_per_tok} distinct experts at real "
                         "widths, so at least that many")
    return args


def reference(a, folder: Path):
    """Write the GGUF, the token ids and transformers' logits of every position into `folder`."""
    import torch

    from ds4_mlx.tools.testing import gguf_metadata, hf_tiny_model, hf_to_gguf_tensors, write_gguf

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args = parity_args(a)
    hf = hf_tiny_model(args, seed=a.seed)
    write_gguf(folder / "model.gguf", gguf_metadata(args), hf_to_gguf_tensors(hf))
    ids = np.random.default_rng(a.seed).integers(0, args.vocab_size, a.tokens)
    device = "cuda" if torch.cuda.is_available() and a.device != "cpu" else "cpu"
    hf = hf.to(device)
    with torch.no_grad():
        logits = hf(torch.tensor(ids[None], device=device), use_cache=False).logits[0].float().cpu().numpy()
    np.save(folder / "ids.npy", ids)
    np.save(folder / "reference.npy", logits)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return args


def compare(got, want, path):
    diff = np.abs(got - want)
    return {f"{path}_max_abs": float(diff.max()), f"{path}_over_1e-2": float((diff.max(-1) > 1e-2).mean()),
            f"{path}_top1": float((got.argmax(-1) == want.argmax(-1)).mean())}


def run_mode(folder: Path, mode: str, decode: int):
    """In a mode process: prefill and decode with our model, compare with the reference."""
    import mlx.core as mx

    import ds4_mlx
    from ds4_mlx.precision import tf32_active
    from ds4_mlx.session import Session

    ids = np.load(folder / "ids.npy")
    want = np.load(folder / "reference.npy", mmap_mode="r")
    model, _ = ds4_mlx.load(folder / "model.gguf", quant_sim=False)
    if mode == "bfloat16":
        model.cast(mx.bfloat16)
    chunk = Session(model).max_chunk
    cache, prefill = model.make_cache(), len(ids) - decode
    got = []
    for start in range(0, prefill, chunk):  # all positions' logits, in the session's chunks
        part = mx.array(ids[None, start : min(prefill, start + chunk)], dtype=mx.int32)
        got.append(np.array(model(part, cache)[0]))
    decoded = [np.array(model(mx.array([[int(t)]], dtype=mx.int32), cache)[0, -1]) for t in ids[prefill:]]
    return {"mode": mode, "tf32": tf32_active(), **compare(np.concatenate(got), want[:prefill], "prefill"),
            **compare(np.stack(decoded), want[prefill:], "decode")}


def bench_parity(a):
    """Logits against transformers (float32) on the same random weights: exact mode, fast defaults, bfloat16."""
    a.tokens = a.tokens or (2600 if a.widths == "real" else 300)
    modes = a.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"unknown modes {unknown}: choose from {sorted(MODES)}")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"bench parity compares against transformers' DeepseekV4ForCausalLM, and {e.name} is not "
                           "installed: pip install 'ds4-mlx[test]'") from None
    with tempfile.TemporaryDirectory(prefix="ds4-parity-") as tmp:
        folder = Path(tmp)
        print("building transformers' model and its logits...", file=sys.stderr, flush=True)
        args = reference(a, folder)
        results = []
        for mode in modes:
            env = {**os.environ, **MODES[mode], "PYTHONPATH": os.pathsep.join(sys.path)}
            command = [sys.executable, "-m", "ds4_mlx.tools.bench_parity", str(folder), mode, str(a.decode)]
            if a.device:
                command.append(a.device)
            out = subprocess.run(command, env=env, capture_output=True, text=True)
            if out.returncode:
                why = (f"killed by signal {-out.returncode}" + (" (out of memory?)" if out.returncode == -9 else "")
                       if out.returncode < 0 else f"exit status {out.returncode}")
                raise RuntimeError(f"mode {mode} failed ({why}):\n{out.stderr[-3000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{mode}: {results[-1]}", file=sys.stderr, flush=True)
    return {"widths": a.widths, "ratios": a.ratios, "hidden": args.hidden_size, "experts": args.n_routed_experts,
            "tokens": a.tokens, "decoded": a.decode, "results": results}


def parity_options(q):
    q.add_argument("--widths", choices=["real", "tiny"], default="tiny",
                   help="real: V4 Flash widths (hours on a CPU: use a GPU); tiny: the real cache geometry at "
                        "tiny widths")
    q.add_argument("--ratios", default="0,4,128", help="compress ratio of each layer (the first is hash-routed)")
    q.add_argument("--experts", type=int, default=16, help="routed experts at real widths")
    q.add_argument("--tokens", type=int, default=None, help="tokens compared, prefill then --decode decoded (default: "
                   "2600 at real widths, past one 2048-token chunk; 300 at tiny widths, where the indexer's top-k "
                   "meets near-tied scores on longer prompts: docs/PRECISION.md)")
    q.add_argument("--decode", type=int, default=16, help="last tokens decoded one at a time")
    q.add_argument("--modes", default="exact,fast,bfloat16", help="comma separated: exact, fast, bfloat16")
    q.add_argument("--seed", type=int, default=0)


if __name__ == "__main__":  # one mode's process: folder, mode, decoded tokens[, device]
    import mlx.core as mx

    if len(sys.argv) > 4:
        mx.set_default_device(mx.cpu if sys.argv[4] == "cpu" else mx.gpu)
    print(json.dumps(run_mode(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))))
