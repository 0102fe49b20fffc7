"""The llm_decoder bias, handled knowingly.

CosyVoice2's head is `llm_decoder(h) = W h + b`; Qwen2's `lm_head` (transformers, vLLM) is `W h`.
Softmax over the allowed ids ignores a constant, so only the centred bias b - mean(b) matters. Two
bias-free representations are measured on the model's own samples:
  drop:  W                              (what the public reference did silently)
  fold:  W + (b - mean b) v^T, with v the ridge solution of  H v ~ 1  over calibration hidden states
         (exact when the final hidden states lie on a hyperplane v.h = 1; the closer, the better)
`auto` keeps the one with the lower KL on held-out positions; a zero bias is converted exactly.

The same direction v also serves the rows that sampling never picks (text tokens, sos, task_id,
padding): where v fits well (v.h ~ 1), setting those rows to -margin * v gives them logits ~ -margin,
the bias-free stand-in for the reference's -inf bias. verl's actor normalises log-probs over the full
vocabulary, so this keeps its distribution equal to the restricted one that rollouts sample from.
The restricted distribution over speech tokens and stop ids is not touched by it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from grpo.model.speech_vocab import SpeechVocab

log = logging.getLogger(__name__)

MAX_CALIBRATION_TOKENS = 48
CALIBRATION_FILE = "conversion_calibration.json"
SUPPRESS_MARGIN = 30.0          # logit of never-sampled rows where v.h ~ 1
SUPPRESS_MAX_RESIDUAL = 0.25    # apply only when the fit of v.h = 1 is at least this good (RMS)


def _allowed_rows(vocab: SpeechVocab) -> torch.Tensor:
    """Head rows (0-based within llm_decoder) that sampling may pick: speech tokens + stop ids."""
    return torch.tensor([i - vocab.speech_token_offset for i in vocab.allowed_token_ids()])


@torch.no_grad()
def calibration_batch(model, tokenizer, vocab: SpeechVocab, bias, texts, n, seed):
    """Prompts from `texts` continued with speech tokens sampled from CosyVoice's own head (with bias)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    T, rows = vocab.speech_token_offset, vocab.num_speech_rows
    allowed = _allowed_rows(vocab)

    class CosyVoiceHead(LogitsProcessor):
        def __call__(self, input_ids, scores):
            h_scores = torch.full_like(scores, float("-inf"))
            speech = scores[:, T:T + rows] + (bias if bias is not None else 0)
            h_scores[:, T + allowed] = speech[:, allowed]
            return h_scores

    gen = torch.Generator().manual_seed(seed)
    if not texts:
        texts = ["".join(chr(0x4E00 + int(c)) for c in torch.randint(0, 2000, (8,), generator=gen)) for _ in range(n)]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}],
                                             tokenize=True, return_dict=False) for i in range(n)]
    torch.manual_seed(seed)
    sequences = []
    for prompt in prompts:  # one at a time: no padding subtleties, n is small
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                             max_new_tokens=MAX_CALIBRATION_TOKENS, min_new_tokens=4,
                             logits_processor=LogitsProcessorList([CosyVoiceHead()]),
                             eos_token_id=vocab.stop_token_ids, pad_token_id=tokenizer.pad_token_id)
        sequences.append((out[0].tolist(), len(prompt)))
    return sequences


@torch.no_grad()
def hidden_states(model, sequences) -> list[torch.Tensor]:
    """Final (normed) hidden states at every position that predicts a speech token."""
    out = []
    for ids, prompt_len in sequences:
        h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
        out.append(h[prompt_len - 1:-1])
    return out


def fit_fold_vector(H: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """v minimising |H v - 1|^2 + lam |v|^2 (lam scaled to H's energy)."""
    d = H.shape[1]
    gram = H.T @ H
    lam = ridge * gram.trace() / d
    return torch.linalg.solve(gram + lam * torch.eye(d), H.T @ torch.ones(H.shape[0]))


def divergence(H, w_ref, b_ref, w_new, allowed) -> dict:
    """KL(p_cosyvoice || p_hf) and top-1 agreement over the allowed rows, averaged over positions."""
    ref = F.log_softmax((H @ w_ref.T + b_ref)[:, allowed], dim=-1)
    new = F.log_softmax((H @ w_new.T)[:, allowed], dim=-1)
    kl = (ref.exp() * (ref - new)).sum(-1)
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agreement": (ref.argmax(-1) == new.argmax(-1)).float().mean().item()}


@torch.no_grad()
def non_speech_mass(model, sequences, vocab: SpeechVocab) -> float:
    """Mean probability the full-vocabulary softmax (what verl's actor uses) puts outside the allowed ids."""
    allowed = torch.tensor(vocab.allowed_token_ids())
    masses = []
    for ids, prompt_len in sequences:
        logits = model(input_ids=torch.tensor([ids])).logits[0, prompt_len - 1:-1].float()
        lse_all = torch.logsumexp(logits, -1)
        lse_allowed = torch.logsumexp(logits[:, allowed], -1)
        masses.append(1 - (lse_allowed - lse_all).exp())
    return max(0.0, torch.cat(masses).mean().item())


def apply(hf_dir: Path, vocab: SpeechVocab, extra: dict, tokenizer, bias_mode: str,
          texts: list[str], n: int, seed: int) -> dict:
    """Decide the head representation, write it into the HF model at `hf_dir`, return the report."""
    from transformers import Qwen2ForCausalLM

    if bias_mode not in ("auto", "drop", "fold"):
        raise ValueError(f"model.bias_mode must be auto, drop or fold, got {bias_mode!r}")
    model = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    W = extra["decoder_weight"].float()
    b = extra["decoder_bias"].float() if extra["decoder_bias"] is not None else None
    T, rows = vocab.speech_token_offset, vocab.num_speech_rows
    allowed = _allowed_rows(vocab)
    sequences = calibration_batch(model, tokenizer, vocab, b, texts, max(n, 2), seed)
    hs = hidden_states(model, sequences)
    fit_h, test_h = torch.cat(hs[0::2]), torch.cat(hs[1::2])
    zero = torch.zeros(rows)
    v = fit_fold_vector(fit_h)
    fit_residual = ((test_h @ v - 1).pow(2).mean().sqrt()).item()

    report = {"fold_rms_residual": fit_residual, "bias_mode": bias_mode, "calibration_sequences": len(sequences),
              "calibration_positions": {"fit": len(fit_h), "measure": len(test_h)}}
    if b is None or not torch.any(b != 0):
        report.update(bias="none" if b is None else "zero", chosen="exact",
                      exact=divergence(test_h, W, zero, W, allowed))
        head = extra["decoder_weight"]
    else:
        centred = b - b[allowed].mean()
        folded = W + torch.outer(centred, v)
        candidates = {"drop": divergence(test_h, W, b, W, allowed),
                      "fold": divergence(test_h, W, b, folded, allowed)}
        chosen = bias_mode if bias_mode != "auto" else min(candidates, key=lambda k: candidates[k]["kl_mean"])
        report.update(bias="nonzero", chosen=chosen, candidates=candidates,
                      bias_stats={"centred_std": centred[allowed].std().item(),
                                  "centred_max_abs": centred[allowed].abs().max().item()})
        head = (folded if chosen == "fold" else W).to(extra["decoder_weight"].dtype)
    with torch.no_grad():
        model.lm_head.weight[T:T + rows] = head.to(model.lm_head.weight.dtype)
    report["non_speech_probability_mass"] = mass_before = non_speech_mass(model, sequences, vocab)
    suppress = fit_residual < SUPPRESS_MAX_RESIDUAL
    if suppress:
        never_sampled = ~vocab.allowed_mask()
        with torch.no_grad():
            model.lm_head.weight[never_sampled] = (-SUPPRESS_MARGIN * v).to(model.lm_head.weight.dtype)
        report["non_speech_probability_mass"] = non_speech_mass(model, sequences, vocab)
    # what the HF head holds now; `delta` export adds (trained - this) to the original head
    extra["converted_head_rows"] = model.lm_head.weight[T:T + rows].detach().clone().to(extra["decoder_weight"].dtype)
    report["non_speech_suppression"] = {"applied": suppress, "margin": SUPPRESS_MARGIN,
                                        "mass_before": mass_before, "mass_after": report["non_speech_probability_mass"]}
    model.save_pretrained(hf_dir)
    # the inputs behind the numbers, so that anyone can recompute them (tests do)
    (hf_dir / CALIBRATION_FILE).write_text(json.dumps(
        {"sequences": [ids for ids, _ in sequences], "prompt_lengths": [n for _, n in sequences],
         "fit": "even indices", "measure": "odd indices"}))
    log.info("lm_head bias: %s -> %s", report.get("bias"), report["chosen"])
    return report


def report_markdown(report: dict) -> str:
    lines = ["# Conversion report", "",
             f"- source: `{report['source']}` ({report['family']})",
             f"- text vocab {report['text_vocab_size']}, speech tokens {report['speech_token_size']}, "
             f"HF vocab {report['vocab_size']}",
             f"- llm_decoder bias: **{report['bias']}**; representation chosen: **{report['chosen']}** "
             f"(mode `{report['bias_mode']}`)",
             f"- calibration: {report['calibration_sequences']} sampled sequences, "
             f"{report['calibration_positions']['measure']} held-out positions", ""]
    rows = report.get("candidates") or {"exact": report.get("exact")}
    lines += ["| representation | KL(cosyvoice ‖ hf) mean | KL max | top-1 agreement |", "|---|---|---|---|"]
    for name, m in rows.items():
        lines.append(f"| {name} | {m['kl_mean']:.3g} | {m['kl_max']:.3g} | {m['top1_agreement']:.4f} |")
    sup = report["non_speech_suppression"]
    lines += ["", f"Fold fit: RMS of (v·h − 1) on held-out positions = {report['fold_rms_residual']:.3g}.", "",
              "Probability the full-vocabulary softmax puts outside speech tokens and stop ids (sampling is "
              "restricted with allowed_token_ids; verl's actor normalises over the full vocabulary): "
              f"{sup['mass_before']:.3g} with zero rows"
              + (f", {sup['mass_after']:.3g} after setting never-sampled rows to −{sup['margin']:g}·v."
                 if sup["applied"] else " (v fits too poorly to suppress them; rows left at zero)."), ""]
    return "\n".join(lines)
