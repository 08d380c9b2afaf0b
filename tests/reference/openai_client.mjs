// Runs a non-streaming and a streaming completion with the official `openai` npm client against
// a pdserve endpoint and prints {"text": ..., "stream_text": ..., "usage": ...} as JSON.
// usage: node openai_client.mjs NODE_MODULES_DIR BASE_URL MODEL PROMPT MAX_TOKENS [API_KEY]
import { createRequire } from 'node:module';
import path from 'node:path';

const [modulesDir, baseURL, model, prompt, maxTokens, apiKey] = process.argv.slice(2);
const require = createRequire(path.join(path.resolve(modulesDir), 'noop.js'));
const OpenAI = require('openai').default ?? require('openai');
const client = new OpenAI({ baseURL, apiKey: apiKey ?? 'test-key', timeout: 60000, maxRetries: 0 });

const r = await client.completions.create({ model, prompt, max_tokens: Number(maxTokens), temperature: 0 });
const stream = await client.completions.create({
  model, prompt, max_tokens: Number(maxTokens), temperature: 0, stream: true,
  stream_options: { include_usage: true },
});
let streamText = '';
let streamUsage = null;
for await (const chunk of stream) {
  for (const c of chunk.choices) streamText += c.text;
  if (chunk.usage) streamUsage = chunk.usage;
}
process.stdout.write(JSON.stringify({
  text: r.choices[0].text, finish: r.choices[0].finish_reason, usage: r.usage,
  stream_text: streamText, stream_usage: streamUsage,
}));
