// node tools/run_model.mjs MODEL.onnx FEEDS.json: runs MODEL on onnxruntime-web (WASM, in Node)
// with the options of the page's sessions (trainer.js sessionOptions) and prints the outputs as
// JSON. FEEDS.json: {name: {dtype: 'float32', dims, data}}. For tests/test_web.py.
import fs from 'fs';
import * as ort from 'onnxruntime-web';
import {sessionOptions} from '../trainer.js';

const [model, feedsPath] = process.argv.slice(2);
const feeds = {};
for (const [name, t] of Object.entries(JSON.parse(fs.readFileSync(feedsPath, 'utf8')))) {
  if (t.dtype !== 'float32') throw new Error(`feed ${name}: ${t.dtype}; this tool takes float32 feeds only`);
  feeds[name] = new ort.Tensor('float32', Float32Array.from(t.data), t.dims);
}
const session = await ort.InferenceSession.create(fs.readFileSync(model),
                                                  sessionOptions(['wasm'], {graphOptimizationLevel: 'all'}));
const out = await session.run(feeds);
console.log(JSON.stringify(Object.fromEntries(Object.entries(out).map(([k, v]) => [k, Array.from(v.data)]))));
