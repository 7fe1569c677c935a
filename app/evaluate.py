"""`python -m app.evaluate --config FILE [--drafter DIR] [--prompts FILE] [key=value ...]`

Greedy speculative decoding with the target on held-out prompts: prints tau (mean tokens per
verify forward, bonus included) and tokens/s beside plain greedy decoding, checks that both give
the same tokens, and ends with `RESULT tau=... tok_s=...`. Exits 1 only when speculative decoding is
not lossless: a kept token that is not its verify forward's own argmax, or, with an fp32 target on
CPU (exact arithmetic), any difference from plain greedy; in bf16 on a GPU a near-tie flip between
the two is reported (`verify_share` of tokens off greedy, `mismatch_rate`, `first_divergence`), not failed on. Without `--drafter` the drafter is freshly
initialised (tau should be close to 1); without `--prompts` the config's held-out prompts are used.
With `--drafter` it also prints the vLLM and SGLang lines that serve that drafter (a run summary's).

Three places, one measurement: this command evaluates a drafter folder on its own, `app/run/evaluate/` is
a training run's evaluation (when, on which target, the best drafter, the final tau), and both decode with
`app/model/drafter_tau.py` (`measure_spec`), the math the target actor runs.
"""
from __future__ import annotations

import argparse
import sys


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app.evaluate", description=__doc__.splitlines()[2])
    p.add_argument("--config", required=True, help="YAML config (e.g. conf/tiny.yaml)")
    p.add_argument("--drafter", default=None, help="exported drafter folder; default: a fresh drafter")
    p.add_argument("--prompts", default=None, help="JSONL of prompts; default: the config's held-out prompts")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p.parse_args(argv)


def run(cfg, drafter_dir: str | None = None, prompts_file: str | None = None):
    """Load target, head and drafter per `cfg`; return the `EvalResult`. The measurement is the run's own
    (`measure_spec`: the same prompts cut, budget and target EOS as every tau of a training run)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.config.checks import read_target_info, resolved_layer_ids, resolved_mask_token_id
    from app.data.dataset import load_eval_prompts
    from app.devices import compute_dtype, pick_device, target_load_kwargs
    from app.model.drafter_tau import EvalSpec, drafter_for, measure_spec, stop_token
    from app.tiny.build import resolve_target

    target = resolve_target(cfg)
    info = read_target_info(target.model_dir)
    device = pick_device(cfg.topology.device)
    dtype = compute_dtype(cfg.model.dtype, device)
    mask_id = resolved_mask_token_id(cfg, info)
    model = AutoModelForCausalLM.from_pretrained(target.model_dir, **target_load_kwargs(device, dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target.model_dir)
    path = prompts_file or target.eval_prompts_file
    if not path:
        raise ValueError("no eval prompts: pass --prompts FILE or set data.eval_prompts in the config")
    prompts = load_eval_prompts(path, tokenizer, cfg.data.enable_thinking)[: cfg.eval.num_prompts]
    if not prompts:
        raise ValueError(f"{path} holds no prompts; give a JSONL with one prompt per line")
    spec = EvalSpec(prompts, cfg.drafter, cfg.eval, mask_id, cfg.train.seed, stop_token(info.eos_token_ids))
    drafter, head, arch = drafter_for(drafter_dir, target.model_dir, resolved_layer_ids(cfg, info), spec, device, dtype)
    return measure_spec(model, drafter, head, arch, spec)


def serve_lines(cfg, model_dir: str, drafter_dir: str) -> dict[str, str]:
    """The launch lines that serve the evaluated drafter, as a run's summary prints them (app/model/engines.py):
    the verifier a run's export would name (`checkpoint.verifier` when set, else the target as engines load
    it), the drafter folder made absolute (an engine starts elsewhere)."""
    from pathlib import Path

    from app.model.gguf_target import serving_name
    from app.model.engines import launch_lines

    local = Path(drafter_dir).expanduser()
    drafter = str(local.resolve()) if local.exists() else drafter_dir  # a URI stays as given
    verifier = getattr(cfg.checkpoint, "verifier", "") or serving_name(cfg.model.target, model_dir)
    return launch_lines(verifier, drafter, cfg.drafter.block_size)


def main(argv: list[str] | None = None) -> int:
    from app.config.load import load_config

    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_config(args.config, args.overrides)
        res = run(cfg, args.drafter, args.prompts)
    except ValueError as e:  # user mistakes: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"prompts={res.num_prompts} new_tokens={res.new_tokens} verify_forwards={res.target_forwards}")
    print(f"tau={res.tau:.3f} (mean tokens per target forward, bonus included)")
    print(f"spec {res.tok_s:.1f} tok/s vs greedy {res.greedy_tok_s:.1f} tok/s: speedup {res.speedup:.2f}x "
          f"(target KV cache in both)")
    print(f"output equals greedy: {res.matches_greedy} (prompts differing {res.mismatch_rate:.3f}, first divergence "
          f"{res.first_divergence}; {'exact check, fp32 on CPU' if res.exact else 'bf16 kernels may flip near-ties'}); "
          f"tokens off greedy: {res.verify_mismatches} of {res.verify_tokens} ({res.verify_share:.4f}); kept tokens "
          f"off their verify argmax: {res.acceptance_errors}")
    if args.drafter:  # how to serve what was just measured
        from app.tiny.build import resolve_target

        for engine, line in serve_lines(cfg, resolve_target(cfg).model_dir, args.drafter).items():
            print(f"serve with {engine}: {line}")
    print(f"RESULT tau={res.tau:.4f} tok_s={res.tok_s:.2f} greedy_tok_s={res.greedy_tok_s:.2f} "
          f"speedup={res.speedup:.3f} matches_greedy={int(res.matches_greedy)} mismatch_rate={res.mismatch_rate:.3f} "
          f"first_divergence={res.first_divergence} verify_mismatches={res.verify_mismatches} "
          f"verify_share={res.verify_share:.4f} lossless={int(res.lossless)}")
    return 0 if res.lossless else 1  # only a real acceptance bug (or any drift on fp32 CPU) fails


if __name__ == "__main__":
    sys.exit(main())
