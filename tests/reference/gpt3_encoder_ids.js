// Encodes every string of a JSON list with the gpt-3-encoder npm package (the real GPT-2
// vocabulary and a JS port of OpenAI's encoder) and prints {"ids": [[...], ...], "text": [...]}
// where text is the package's decode of its own ids.
// usage: node gpt3_encoder_ids.js PACKAGE_DIR STRINGS.json
const fs = require('fs');
const path = require('path');
const { encode, decode } = require(path.resolve(process.argv[2]));
const strings = JSON.parse(fs.readFileSync(process.argv[3], 'utf-8'));
const ids = strings.map((s) => encode(s));
process.stdout.write(JSON.stringify({ ids, text: ids.map((t) => decode(t)) }));
