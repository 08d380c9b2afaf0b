// Runs a chat completion with tools in the request, non-streaming and streaming (with usage), with
// the official `openai` npm client against a pdserve endpoint, and prints
// {"text", "finish", "role", "usage", "stream_text", "stream_role", "stream_finish", "stream_usage", "version"}.
// usage: node openai_chat.mjs NODE_MODULES_DIR BASE_URL MODEL MAX_TOKENS
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

const [modulesDir, baseURL, model, maxTokens] = process.argv.slice(2);
const require = createRequire(path.join(path.resolve(modulesDir), 'noop.js'));
const OpenAI = require('openai').default ?? require('openai');
const version = JSON.parse(fs.readFileSync(path.join(modulesDir, 'openai', 'package.json'), 'utf-8')).version;
const client = new OpenAI({ baseURL, apiKey: 'test-key', timeout: 60000, maxRetries: 0 });

const tools = [{
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Get the current weather for a city.',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  },
}];
const messages = [
  { role: 'system', content: 'You are a weather bot.' },
  { role: 'user', content: 'What is the weather in Paris?' },
  { role: 'assistant', content: null,
    tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }] },
  { role: 'tool', tool_call_id: 'call_1', content: '{"temp_c": 21}' },
  { role: 'user', content: [{ type: 'text', text: 'And should I take an umbrella?' }] },
];
// tool_choice "none": the tools are rendered into the prompt and the reply is text (pdserve has no
// tool-call parser yet, so "auto", the default with tools, is refused as vLLM refuses it without one)
const req = { model, messages, tools, tool_choice: 'none', max_tokens: Number(maxTokens), temperature: 0 };
const r = await client.chat.completions.create(req);
const stream = await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
let streamText = '';
let streamRole = null;
let streamFinish = null;
let streamUsage = null;
for await (const chunk of stream) {
  for (const c of chunk.choices) {
    if (c.delta.role) streamRole = c.delta.role;
    if (c.delta.content) streamText += c.delta.content;
    if (c.finish_reason) streamFinish = c.finish_reason;
  }
  if (chunk.usage) streamUsage = chunk.usage;
}
process.stdout.write(JSON.stringify({
  version, text: r.choices[0].message.content, role: r.choices[0].message.role,
  finish: r.choices[0].finish_reason, usage: r.usage, object: r.object,
  stream_text: streamText, stream_role: streamRole, stream_finish: streamFinish, stream_usage: streamUsage,
}));
