// node tools/train_steps.mjs STEP.json BATCHES.json LR OUT.onnx: the page's Trainer (trainer.js)
// on onnxruntime-web (WASM, in Node) takes one step per batch of BATCHES.json
// ([{name: {dtype: 'float32' | 'int64', dims, data}}]) from the export whose manifest is STEP.json
// (its step and model files beside it), writes the download (modelBytes) to OUT.onnx and prints
// {"losses": [...]}. For tests/test_web.py.
import fs from 'fs';
import path from 'path';
import * as ort from 'onnxruntime-web';
import {Trainer, checkManifest} from '../trainer.js';

const [manifestPath, batchesPath, lr, out] = process.argv.slice(2);
const manifest = checkManifest(JSON.parse(fs.readFileSync(manifestPath, 'utf8')), manifestPath);
const read = role => fs.readFileSync(path.join(path.dirname(manifestPath), manifest.files[role].name));
const trainer = await Trainer.create(ort, manifest, read('step'), read('model'));
const tensor = t => t.dtype === 'int64'
  ? new ort.Tensor('int64', BigInt64Array.from(t.data, BigInt), t.dims)
  : new ort.Tensor('float32', Float32Array.from(t.data), t.dims);
const losses = [];
for (const batch of JSON.parse(fs.readFileSync(batchesPath, 'utf8'))) {
  const feeds = Object.fromEntries(Object.entries(batch).map(([k, t]) => [k, tensor(t)]));
  losses.push(await trainer.step(feeds, Number(lr)));
}
fs.writeFileSync(out, await trainer.modelBytes());
console.log(JSON.stringify({losses}));
