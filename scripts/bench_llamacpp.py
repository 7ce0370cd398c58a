"""llama.cpp (llama-cpp-python) on the same GGUF: batch-1 decode and prompt-processing tokens/s.

Usage: python scripts/bench_llamacpp.py MODEL.gguf THREADS  -> prints one JSON object.
"""
import json
import sys
import time

from llama_cpp import Llama

model, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
lorem = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
         "combined movable metal type, oil-based ink and a wooden press adapted from wine making. ") * 40


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


decode(32, 8)  # warm-up
print(json.dumps({"threads": threads, "batch1_decode_tps": decode(32, 128), "prefill_tps": prefill(512)}))
