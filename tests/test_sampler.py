"""BatchedSampler: static-cache batched decoding for data generation (greedy = model.generate; sampling exact)."""

import pytest
import torch
from tiny_targets import TINY_TARGETS, VOCAB

from modeling_weaver.lab.sampler import BatchedSampler

EOS = [VOCAB - 1, VOCAB - 2]


def hf_greedy(model, prompts, new):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    device = next(model.parameters()).device
    out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=new,
                         pad_token_id=0, eos_token_id=EOS)
    return out[:, width:].tolist()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_equals_generate_on_left_padded_batches(name):
    model = TINY_TARGETS[name]()
    gen = torch.Generator().manual_seed(0)
    sampler = BatchedSampler(model, batch_size=6, max_length=64)
    for lengths in [(3, 9, 5, 1), (12,), (2, 2, 7, 4, 11, 6)]:  # the same buffers serve every batch
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
        got = sampler.generate(prompts, 24, eos_token_id=EOS)
        for (tokens, finished), ref in zip(got, hf_greedy(model, prompts, 24)):
            assert tokens == ref[: len(tokens)]
            assert finished == (tokens[-1] in EOS) and (finished or len(tokens) == 24)


def test_sampling_follows_the_tempered_nucleus():
    """First sampled token of 3000 copies of one prompt vs softmax(logits / T) on the top-p nucleus (χ²)."""
    model = TINY_TARGETS["llama"]()
    prompt = [5, 17, 3]
    T, top_p = 0.7, 0.9
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / T, -1)
    order = probs.argsort(descending=True)
    keep = (probs[order].cumsum(0) - probs[order]) <= top_p
    nucleus = torch.zeros_like(probs)
    nucleus[order[keep]] = probs[order[keep]]
    nucleus /= nucleus.sum()
    torch.manual_seed(0)
    sampler = BatchedSampler(model, batch_size=3000, max_length=8)
    first = torch.tensor([toks[0] for toks, _ in sampler.generate([prompt] * 3000, 1, EOS, temperature=T,
                                                                   top_p=top_p)])
    counts = torch.bincount(first, minlength=VOCAB).double()
    assert counts[nucleus == 0].sum() == 0, "a token outside the nucleus was drawn"
    support = nucleus > 0
    expected = 3000 * nucleus[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # ≈ 5σ above the mean of χ²(dof)


def test_refuses_hybrid_targets_and_overlong_requests():
    with pytest.raises(ValueError, match="supports"):
        BatchedSampler(TINY_TARGETS["qwen3_5"](), batch_size=2, max_length=16)
    sampler = BatchedSampler(TINY_TARGETS["llama"](), batch_size=2, max_length=16)
    with pytest.raises(ValueError, match="max_length"):
        sampler.generate([[1] * 10], 10, EOS)
    with pytest.raises(ValueError, match="prompts"):
        sampler.generate([[1]] * 3, 2, EOS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_decode_step_equals_generate_on_gpu():
    model = TINY_TARGETS["llama"]().cuda()
    gen = torch.Generator().manual_seed(3)
    sampler = BatchedSampler(model, batch_size=5, max_length=64)
    assert sampler.capture
    for lengths in [(3, 9, 5), (1, 12, 2, 8, 4)]:
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
        got = sampler.generate(prompts, 30, eos_token_id=EOS)
        for (tokens, _), ref in zip(got, hf_greedy(model, prompts, 30)):
            assert tokens == ref[: len(tokens)]
    assert sampler.capture and sampler._graph is not None  # captured, not fallen back to eager
