"""Engine-only decode sweep on CUDA: sync vs async token handoff, random bf16 weights of real
shapes (load_format=dummy), prompt 256, output 128, batch 1/8/64/256. Fast check, no HF.

    PYTHONPATH=. python3 bench/smoke_gpu.py qwen0.5b,llama8b
"""
import time, os, sys, tempfile, torch
from transformers import Qwen2Config, LlamaConfig, GenerationConfig
from backend_lib import EngineConfig, LLMEngine, SamplingParams
def preset_dir(name):
    d = tempfile.mkdtemp()
    if name == "qwen0.5b":
        c = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)
    else:
        c = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, max_position_embeddings=4096, rope_theta=5e5)
    c.save_pretrained(d); GenerationConfig(eos_token_id=2).save_pretrained(d)
    return d
for name in sys.argv[1].split(","):
    d = preset_dir(name)
    for mode in ("off", "on"):
        t0=time.time()
        eng = LLMEngine(EngineConfig(model_path=d, device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=256,
                                     max_model_len=1024, async_token_handoff=mode, gpu_memory_utilization=0.5))
        init=time.time()-t0
        for B in (1, 8, 64, 256):
            prompts = [[(i * 7 + j) % 1000 + 3 for j in range(256)] for i in range(B)]
            sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
            for i,p in enumerate(prompts): eng.add_request(f"w{B}{i}", p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            while eng.has_unfinished(): eng.step()
            for i,p in enumerate(prompts): eng.add_request(f"b{B}{i}", p, sp)
            # run prefill until every request has its first token
            ntok = 0
            while ntok < B:
                ntok += sum(1 for o in eng.step() if o.num_output_tokens == 1 and o.new_token_ids)
            eng.stats(); torch.cuda.synchronize()
            s0 = eng.stats(); t = time.perf_counter(); gen = 0
            while eng.has_unfinished():
                gen += sum(len(o.new_token_ids) for o in eng.step())
            dt = time.perf_counter() - t; s1 = eng.stats()
            gaps = sorted(s1.gpu_idle_gap_us) or [0]
            steps = 127
            print(f"{name} async={mode} B={B} TPOT={dt/steps*1e3:.3f}ms tok/s={gen/dt:.0f} host_step_us={(s1.step_time_s-s0.step_time_s-(s1.wait_time_s-s0.wait_time_s))/steps*1e6:.0f} gap_p50={gaps[len(gaps)//2]:.1f}us gap_p99={gaps[int(len(gaps)*0.99)]:.1f}us busy={1-sum(gaps)/1e6/dt:.3f} init={init:.0f}s", flush=True)
        del eng; torch.cuda.empty_cache()
