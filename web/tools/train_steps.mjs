// node tools/train_steps.mjs STEP.json BATCHES.json LR OUT.onnx: the page's Trainer (trainer.js)
// on onnxruntime-web (WASM, in Node) takes one step per batch of BATCHES.json
// ([{name: {dtype: 'float32' | 'int64' | 'float16' (data: its bits), dims, data}}]) from the export
// whose manifest is STEP.json (its step and model files beside it), writes the download (modelBytes)
// to OUT.onnx and prints {"losses": [...]}. For tests/test_web.py.
import fs from 'fs';
import path from 'path';
import * as ort from 'onnxruntime-web';
import {Trainer, checkManifest} from '../trainer.js';

const [manifestPath, batchesPath, lr, out] = process.argv.slice(2);
const manifest = checkManifest(JSON.parse(fs.readFileSync(manifestPath, 'utf8')), manifestPath);
const read = role => fs.readFileSync(path.join(path.dirname(manifestPath), manifest.files[role].name));
const trainer = await Trainer.create(ort, manifest, read('step'), read('model'));
const ARRAYS = {int64: d => BigInt64Array.from(d, BigInt), float32: d => Float32Array.from(d),
                float16: d => Uint16Array.from(d)};  // (float16: the values' IEEE bits)
const tensor = t => new ort.Tensor(t.dtype, ARRAYS[t.dtype](t.data), t.dims);
const losses = [];
for (const batch of JSON.parse(fs.readFileSync(batchesPath, 'utf8'))) {
  const feeds = Object.fromEntries(Object.entries(batch).map(([k, t]) => [k, tensor(t)]));
  losses.push(await trainer.step(feeds, Number(lr)));
}
fs.writeFileSync(out, await trainer.modelBytes());
console.log(JSON.stringify({losses}));
