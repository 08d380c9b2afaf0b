// Encodes and decodes with @lenml/tokenizers (a port of transformers.js' tokenizers) and the real
// tokenizer.json / tokenizer_config.json of a @lenml/tokenizer-NAME package, and prints
// {"encode": [[ids]...], "encode_plain": [[ids]...], "decode": [text...], "decode_skip": [text...]}
// where encode adds special tokens as the tokenizer does by default, encode_plain does not, and the
// decodes are of the given id lists with and without special tokens.
// usage: node lenml_tokenize.mjs NODE_MODULES_DIR NAME STRINGS.json IDS.json
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

const [modulesDir, name, stringsPath, idsPath] = process.argv.slice(2);
const require = createRequire(path.join(path.resolve(modulesDir), 'noop.js'));
const { TokenizerLoader } = require('@lenml/tokenizers');
const dir = path.join(modulesDir, '@lenml', `tokenizer-${name}`, 'models');
const tokenizerJSON = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer.json'), 'utf-8'));
const tokenizerConfig = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf-8'));
const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
const strings = JSON.parse(fs.readFileSync(stringsPath, 'utf-8'));
const idLists = JSON.parse(fs.readFileSync(idsPath, 'utf-8'));
const out = {
  encode: strings.map((s) => Array.from(tok.encode(s, { add_special_tokens: true }))),
  encode_plain: strings.map((s) => Array.from(tok.encode(s, { add_special_tokens: false }))),
  // transformers.js refuses an empty list; its decode is the empty string
  decode: idLists.map((ids) => (ids.length ? tok.decode(ids, { skip_special_tokens: false }) : '')),
  decode_skip: idLists.map((ids) => (ids.length ? tok.decode(ids, { skip_special_tokens: true }) : '')),
};
process.stdout.write(JSON.stringify(out));
