"""A tiny model taught what to say, for the tests that need sequences of known lengths.

What the warm-started tiny model generates depends on the CPU that trained it (AMX and
AVX-512 round differently, so the Intel and AMD builds are different models): on one
machine greedy sequences end at many lengths, on another all after one token. A test that
needs sequences ending at different steps (slot refills, speculation that ends on EOS)
builds that condition here: the tiny model is fine-tuned on a few prompt → completion
pairs until greedy decoding returns exactly those completions, each followed by EOS.
"""

from __future__ import annotations

from pathlib import Path

import torch

PROMPTS = ["1+2=", "what is 13*7?", "3", "hello there, how are you today", "9-4=", "12*12="]
# Greedy completions of 1 to 29 characters (one token each, then EOS): sequences end at
# different steps, and one runs past the budgets the tests give.
COMPLETIONS = {
    "1+2=": "3",
    "what is 13*7?": " 91",
    "3": " is three, and this goes on for long",
    "hello there, how are you today": " fine, thanks",
    "9-4=": "5 (five)",
    "12*12=": "144, a gross",
}


def teach(model_dir: str | Path, out_dir: str | Path, completions=None, max_steps=600) -> Path:
    """`model_dir`'s model fine-tuned (FP32, full batch) until greedy decoding of every
    prompt gives its completion then EOS; saved in `out_dir`. Raises if it cannot."""
    from asyncfp8.models import load_model, load_tokenizer

    completions = completions or COMPLETIONS
    torch.manual_seed(0)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    rows, labels = [], []
    for prompt, completion in completions.items():
        prompt_ids = tokenizer(prompt)["input_ids"]
        target = tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + target)
        labels.append([-100] * len(prompt_ids) + target)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    batch = {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([x + [-100] * (width - len(x)) for x in labels]),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(max_steps):
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        # Taught once every target token is far ahead of the runner-up (loss per token
        # below 0.01: probability above 0.99), so no CPU's rounding can change a choice.
        if step % 25 == 24 and loss.item() < 0.01 and greedy_matches(model, tokenizer, completions):
            out = Path(out_dir)
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
            return out
    raise RuntimeError(f"the tiny model did not learn its completions in {max_steps} steps")


@torch.no_grad()
def greedy_matches(model, tokenizer, completions) -> bool:
    for prompt, completion in completions.items():
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        target = tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id]
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=len(target) + 1,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        if out[0, ids.shape[1] :].tolist() != target:
            return False
    return True
