// bench/llamacpp/baseline.mjs — llama.cpp on the same weights as pdserve, on the same machine, as the
// baseline of pd-bench-ops's model rows (issue 18). llama.cpp comes from npm as node-llama-cpp's
// prebuilt CPU binaries (ggml picks its kernel variant for this CPU at load: the log says which),
// the model from tools/pd-to-gguf.py. Measures, with n threads:
//   decode: a prompt of --prompt-len tokens, then --steps greedy tokens; tok/s over the steps after
//           the first (the first is the prompt's forward), as pd-bench-ops's "batch 1" row;
//   forward: the same prompt, then --steps single-token forwards without sampling (llama.cpp's
//           graph alone, without node-llama-cpp's per-token sampling and scheduling);
//   prefill: --prefill lengths, each a fresh sequence, tok/s of the whole prompt's forward;
// each --reps times (the median is printed). --tokens-out FILE writes the greedy tokens of the first
// decode run (JSON: prompt and output ids) so that a pdserve run on the same prompt can be compared.
// Usage: node bench/llamacpp/baseline.mjs --model M.gguf [--threads 2] [--prompt-len 64] [--steps 64]
//        [--prefill 512,2048] [--reps 3] [--tokens-out F]
import { writeFileSync } from "node:fs";
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

function parseArgs(argv) {
    const a = { threads: 2, promptLen: 64, steps: 64, prefill: [512, 2048], reps: 3, tokensOut: null };
    for (let i = 2; i < argv.length; i += 2) {
        const k = argv[i], v = argv[i + 1];
        if (v === undefined) throw new Error(`${k} needs a value`);
        if (k === "--model") a.model = v;
        else if (k === "--threads") a.threads = Number(v);
        else if (k === "--prompt-len") a.promptLen = Number(v);
        else if (k === "--steps") a.steps = Number(v);
        else if (k === "--prefill") a.prefill = v.split(",").filter(Boolean).map(Number);
        else if (k === "--reps") a.reps = Number(v);
        else if (k === "--tokens-out") a.tokensOut = v;
        else throw new Error(`unknown option ${k}`);
    }
    if (!a.model) throw new Error("--model M.gguf is required");
    return a;
}

// The prompt: ids i·7919 + 13 modulo the vocabulary less its two special tokens, no BOS (the
// caller sends pd-serve the same ids, from --tokens-out).
function promptIds(n, vocab) {
    const ids = [];
    for (let i = 0; i < n; i++) ids.push((i * 7919 + 13) % (vocab - 2));
    return ids;
}

const median = (xs) => [...xs].sort((x, y) => x - y)[Math.floor(xs.length / 2)];

async function main() {
    const a = parseArgs(process.argv);
    const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error });
    const model = await llama.loadModel({ modelPath: a.model, gpuLayers: 0, useMmap: true });
    const maxLen = Math.max(a.promptLen + a.steps, ...a.prefill) + 16;
    const ctx = await model.createContext({ contextSize: maxLen, batchSize: 512, threads: a.threads, sequences: 1 });
    const seq = ctx.getSequence();
    const vocab = model.fileInfo.metadata.llama.vocab_size;
    console.error(`llama.cpp: ${llama.systemInfo.trim()}`);
    console.error(`llama.cpp: ${a.model}: ${(model.size / 2 ** 20).toFixed(1)} MiB, ${a.threads} threads`);

    const decode = [], forward = [];
    let firstOut = null;
    for (let r = -1; r < a.reps; r++) { // r = -1: a warm-up run, not counted
        await seq.clearHistory();
        const prompt = promptIds(a.promptLen, vocab);
        const out = [], times = [];
        for await (const t of seq.evaluate(prompt, { temperature: 0, yieldEogToken: true })) {
            out.push(t);
            times.push(performance.now());
            if (out.length === a.steps) break;
        }
        if (r >= 0) decode.push(((out.length - 1) * 1000) / (times[times.length - 1] - times[0]));
        if (firstOut === null) firstOut = { prompt, output: out };
        await seq.clearHistory();
        await seq.evaluateWithoutGeneratingNewTokens(prompt);
        const t0 = performance.now();
        for (let i = 0; i < a.steps; i++) await seq.evaluateWithoutGeneratingNewTokens([out[i]]);
        if (r >= 0) forward.push((a.steps * 1000) / (performance.now() - t0));
    }
    const prefill = {};
    for (const len of a.prefill) {
        prefill[len] = [];
        for (let r = 0; r < a.reps; r++) {
            await seq.clearHistory();
            const t0 = performance.now();
            await seq.evaluateWithoutGeneratingNewTokens(promptIds(len, vocab));
            prefill[len].push((len * 1000) / (performance.now() - t0));
        }
    }
    if (a.tokensOut) writeFileSync(a.tokensOut, JSON.stringify(firstOut));
    const res = {
        model: a.model,
        threads: a.threads,
        decode_tok_s: median(decode),
        decode_runs: decode,
        forward_tok_s: median(forward),
        forward_runs: forward,
        prefill_tok_s: Object.fromEntries(Object.entries(prefill).map(([k, v]) => [k, median(v)])),
        prefill_runs: prefill,
    };
    console.log(JSON.stringify(res));
    await ctx.dispose();
    await model.dispose();
}

main().catch((e) => {
    console.error(`llamacpp-baseline: ${e.message}`);
    process.exit(1);
});
