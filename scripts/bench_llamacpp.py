"""llama.cpp (llama-cpp-python) on the same GGUF: batch-1 decode, prompt-processing, and
batched decode (N sequences stepped together through llama_decode, as llama-batched-bench does).

Usage: python scripts/bench_llamacpp.py MODEL.gguf THREADS [SEQS [PROMPT GEN]]  -> prints one JSON object.

Batched decode runs twice: at llama-batched-bench's short shape (32-token prompts, 64 steps:
`batchedN_decode_tps`) and, when PROMPT and GEN are given, at the shape of our HTTP benchmark's
short streams (`batchedN_at_shape_decode_tps`, e.g. 110-token prompts and 256 steps), so the
16-stream comparison can be read at the same contexts on both sides.
"""
import ctypes
import json
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama

model, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=model, n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
lorem = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
         "combined movable metal type, oil-based ink and a wooden press adapted from wine making. ") * 100


def decode(n_prompt, n_gen):
    toks = llm.tokenize(lorem.encode(), add_bos=False)[:n_prompt]
    llm.reset()
    llm.eval(toks)
    t0 = time.perf_counter()
    for _ in range(n_gen):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    return n_gen / (time.perf_counter() - t0)


def prefill(n):
    toks = llm.tokenize(lorem.encode(), add_bos=False)[:n]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(toks)
    return n / (time.perf_counter() - t0)


def batched_decode(n_seq, n_prompt, n_gen):
    """n_seq sequences with distinct n_prompt-token prompts, then n_gen greedy steps in which one
    llama_decode call advances every sequence by one token. Returns aggregate decode tokens/s."""
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_seq * (n_prompt + n_gen + 8)
    cparams.n_batch = max(512, n_seq * n_prompt)
    cparams.n_ubatch = 512
    cparams.n_seq_max = n_seq
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(llm.model, cparams)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
    base = llm.tokenize(lorem.encode(), add_bos=False)
    batch = llama_cpp.llama_batch_init(max(n_seq * n_prompt, n_seq), 0, 1)

    def run(items):  # items: (token, pos, seq, want_logits)
        batch.n_tokens = len(items)
        for i, (t, p, s, lg) in enumerate(items):
            batch.token[i] = t
            batch.pos[i] = p
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = s
            batch.logits[i] = lg
        assert llama_cpp.llama_decode(ctx, batch) == 0

    def argmax(i):
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())

    items = []
    for s in range(n_seq):
        toks = base[s:s + n_prompt]
        items += [(t, p, s, False) for p, t in enumerate(toks)]
    for k in range(0, len(items), cparams.n_batch):
        run(items[k:k + cparams.n_batch])
    # Throughput only: each sequence's first generated token is taken from the text; every
    # later one is its greedy argmax.
    nxt = [base[s + n_prompt] for s in range(n_seq)]
    t0 = time.perf_counter()
    for step in range(n_gen):
        run([(nxt[s], n_prompt + step, s, True) for s in range(n_seq)])
        nxt = [argmax(s) for s in range(n_seq)]
    dt = time.perf_counter() - t0
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return n_seq * n_gen / dt


seqs = int(sys.argv[3]) if len(sys.argv) > 3 else 16
decode(32, 8)  # warm-up
out = {"threads": threads, "batch1_decode_tps": decode(32, 128), "prefill_tps": prefill(512), "prefill_1400_tps": prefill(1400)}
batched_decode(2, 16, 4)  # warm-up
out[f"batched{seqs}_decode_tps"] = batched_decode(seqs, 32, 64)
if len(sys.argv) > 5:
    n_prompt, n_gen = int(sys.argv[4]), int(sys.argv[5])
    out[f"batched{seqs}_at_shape_decode_tps"] = batched_decode(seqs, n_prompt, n_gen)
    out["shape"] = {"prompt_tokens": n_prompt, "generated": n_gen}
print(json.dumps(out))
