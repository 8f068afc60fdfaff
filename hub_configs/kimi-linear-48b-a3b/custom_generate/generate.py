# Generated from custom_generate/generate.py — do not edit; edit the source and run `weaver export`.
"""Lossless tree speculative decoding (DFlash drafter + Weaver trees) as a Hub ``custom_generate`` recipe.

    out = target.generate(
        input_ids, custom_generate="<this repo or folder>", trust_remote_code=True,
        drafter=drafter, weaver=weaver,        # loaded models, or paths / Hub ids of their folders
        mode="weaver", tree_budget=64,         # or mode="ddtree" / "chain" (no weaver needed)
        max_new_tokens=256,                    # any generation_config field: do_sample, temperature, top_k, eos...
    )

Greedy output is token-identical to ``target.generate(input_ids, do_sample=False)``; sampling is exact in
distribution. Batch size 1. The loop itself lives in the ``modeling-weaver`` package (see requirements.txt): this file
only resolves the drafters and hands transformers our decoding function, so the Hub path and
``modeling_weaver.speculative_generate`` run the same code.
"""

from modeling_weaver.export import resolve_drafters
from modeling_weaver.generate import generate as tree_speculative_decoding
from modeling_weaver.generate import refuse


def generate(model, *args, drafter=None, weaver=None, **kwargs):
    # transformers drops assistant_model before a callable custom_generate runs: refuse it while it is in view
    if kwargs.get("assistant_model") is not None:
        raise refuse("assistant_model")
    drafter, weaver, defaults = resolve_drafters(model, drafter, weaver)
    # transformers keeps `streamer` for itself with a callable custom_generate; ours takes it as `tree_streamer`
    if kwargs.get("streamer") is not None:
        kwargs["tree_streamer"] = kwargs.pop("streamer")
    for key, value in defaults.items():  # the repo's generation defaults (mode, tree_budget), unless given
        kwargs.setdefault(key, value)
    # type(model).generate, not model.generate: the instance may itself be bound to this recipe.
    return type(model).generate(
        model, *args, custom_generate=tree_speculative_decoding, drafter=drafter, weaver=weaver, **kwargs
    )
