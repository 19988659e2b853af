"""A tiny Llama model and tokenizer, built locally and deterministically (no model hub).

Its output is gibberish, but vLLM serves it with every real mechanism: batching, paged KV cache,
prefix caching, chunked prefill, metrics, logs and traces. Shapes follow what vLLM's CPU backend
accepts (head_dim 64; it rejects 16). Two builds with the same seed are byte-identical.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

DEFAULT_DIR = Path("servescope-data") / "models" / "tiny"
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


def make_tiny_model(out_dir: Path = DEFAULT_DIR, *, seed: int = SEED) -> Path:
    """Build the model into `out_dir` (created or overwritten) and return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
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
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


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
