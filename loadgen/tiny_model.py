"""Tiny Llama models and their tokenizer, built locally and deterministically (no model hub).

Two kinds, same shapes, same tokenizer, same cost per token:

- `random` (the default, `models/tiny` in the data folder): random weights. Its output is gibberish,
  but vLLM serves it with every real mechanism: batching, paged KV cache, prefix caching, chunked
  prefill, metrics, logs and traces.
- `predictable` (`models/tiny-predictable`): hand-set weights that make greedy
  decoding recite `PASSAGE`, a cycle of 71 words that are one token each: after passage word i
  the model says word i+1 (after the last, the first), after any other token the first word. A
  prompt that quotes the passage is therefore continued by text the prompt already holds, the
  situation n-gram speculative decoding is built for (code edits, extraction): the drafts vLLM
  looks up in the prompt are the tokens the model then verifies. A prompt whose word pairs
  continue differently (`decoy_text`) gets drafts proposed and rejected.

  How: the residual stream carries only the current token's embedding, a one-hot "which passage
  word" code (dimension 1+i for passage word i, dimension 0 for every other token). Every
  attention output projection and MLP down projection is zero, so the layers add nothing (they
  still run: the same FLOPs, KV cache and scheduling as the random model). The untied LM head
  maps dimension 1+i to the next word's logit (and dimension 0 to the first word's), so after the
  final RMSNorm (which scales the one-hot to 16) the next word leads every other token by 16
  logits. Attention and MLP input weights stay random (seeded).

Shapes follow what vLLM's CPU backend accepts (head_dim 64; it rejects 16). Two builds of the
same kind and seed are byte-identical.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from servescope.store import settings

KINDS = ("random", "predictable")
FOLDERS = {"random": "tiny", "predictable": "tiny-predictable"}  # under the models folder
VOCAB_SIZE = 1024
MAX_POSITIONS = 32768
SEED = 20260512

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The tokenizer's training text: the vocabulary of the course this tool serves.
CORPUS = """
vLLM serves large language models with continuous batching and a paged key value cache.
Prefix caching reuses the blocks of a shared prompt prefix, so the time to first token falls
when many requests start with the same system prompt, tool schema or repository snapshot.
Chunked prefill splits a long prompt into pieces that share each step with decoding requests,
which keeps the time per output token steady while a long summarization request is admitted.
The scheduler holds requests in a waiting queue until the KV cache has room; preemption evicts
running sequences when memory runs out. Operators watch TTFT, TPOT, queue time, the prefix cache
hit ratio and the error rate, and they compare p50, p95 and p99 before and after each change.
An admission gateway protects the server: each team has a queue, a concurrency limit and a token
budget, and a rejection is a boundary protection event rather than a failure.
def handler(request): return {"status": 200, "tokens": len(request.prompt)}
for i in range(10): total = total + i * 2 - 1
The quick brown fox jumps over the lazy dog while the model writes code, reviews a diff, reads a
document, answers a question, and plans the next step of an agent loop with tools and memory.
0123456789 !?.,;:()[]{}<>+-*/=_#@$%&|\\'"`~^
"""

# What the predictable model recites, in a cycle: words of CORPUS that the tokenizer keeps as one
# token each with their leading space (checked when the model is built).
_PASSAGE_TEXT = """
the scheduler holds each request in waiting queue until cache has room preemption evicts
sequences when memory runs out prefix caching reuses blocks of shared prompt so time to first
token falls prefill splits long pieces that share step with decoding keeps steady while
summarization admitted gateway protects server team limit rejection boundary protection event
rather than failure model writes code reviews diff reads answers question plans next agent loop
tools
"""
PASSAGE = _PASSAGE_TEXT.split()


def model_dir(kind: str = "random") -> Path:
    """Where the model of `kind` is built and read by default: under the data folder's
    `models/` (`store.settings`)."""
    return settings.models_dir() / FOLDERS[kind]


def make_tiny_model(out_dir: Path | None = None, *, seed: int = SEED, kind: str = "random") -> Path:
    """Build the model of `kind` (see the module docstring) into `out_dir` (created or
    overwritten; default `model_dir(kind)`) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; one of {', '.join(KINDS)}")
    out_dir = out_dir or model_dir(kind)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=kind == "random",
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    if kind == "predictable":
        _recite_passage(model, passage_ids(tok))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _tokenizer(out_dir: Path) -> Any:
    """The byte-level BPE tokenizer (trained on CORPUS), saved into `out_dir`; both kinds share
    it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return tok


def passage_ids(tok: Any) -> list[int]:
    """The passage's token ids (one per word, with its leading space)."""
    ids = []
    for word in PASSAGE:
        encoded = tok.encode(" " + word, add_special_tokens=False).ids
        if len(encoded) != 1:
            raise ValueError(f"passage word {word!r} is {len(encoded)} tokens, not one")
        ids.append(encoded[0])
    if len(set(ids)) != len(ids):
        raise ValueError("passage words must be distinct: the model maps each to the next")
    return ids


def _recite_passage(model: Any, ids: list[int]) -> None:
    """Hand-set weights: next token = the passage's next word (see the module docstring)."""
    import torch

    hidden = model.config.hidden_size
    if len(ids) + 1 > hidden:
        raise ValueError(f"a passage of {len(ids)} words needs a hidden size above {len(ids)}")
    with torch.no_grad():
        embed = torch.zeros_like(model.model.embed_tokens.weight)
        embed[:, 0] = 1.0  # any token outside the passage
        head = torch.zeros_like(model.lm_head.weight)
        head[ids[0], 0] = 1.0  # ... is followed by the first word
        for i, token in enumerate(ids):
            embed[token, 0] = 0.0
            embed[token, 1 + i] = 1.0
            head[ids[(i + 1) % len(ids)], 1 + i] = 1.0
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def checksum(model_dir: Path) -> str:
    """sha256 over every file's name and bytes: equal for two identical builds."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        digest.update(path.relative_to(model_dir).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def is_built(model_dir: Path) -> bool:
    return (
        (model_dir / "config.json").exists()
        and (model_dir / "model.safetensors").exists()
        and (model_dir / "tokenizer.json").exists()
    )
