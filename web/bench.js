// The browser half of bench/web.py: steps/s of onnxgrad's web train steps on onnxruntime-web (WASM)
// against TensorFlow.js 4.22 (its WASM backend) training the same MLP from the same weights, in
// this page, alternating timed windows. Query: ?cases=[{name, layers, batch, lr, warmup, steps,
// rounds}]&threads=N; the steps' files are under data/ (mounted by bench/web.py). The result is
// left in window.result.
import * as ort from './node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';
import {Trainer, checkManifest} from './trainer.js';

const tf = globalThis.tf;
const q = new URLSearchParams(location.search);
const cases = JSON.parse(q.get('cases'));
const threads = +q.get('threads') || navigator.hardwareConcurrency;
ort.env.wasm.wasmPaths = new URL('node_modules/onnxruntime-web/dist/', import.meta.url).href;
ort.env.wasm.numThreads = threads;
ort.env.logLevel = 'error';

const bytes = async url => (await fetch(url)).arrayBuffer();
const median = a => [...a].sort((x, y) => x - y)[a.length >> 1];

function rng(seed) {
  return () => ((seed = Math.imul(seed ^ (seed >>> 15), 0x2c1b3c6d) + 0x6D2B79F5 | 0) >>> 0) / 4294967296;
}

async function runCase(c) {
  const m = checkManifest(await (await fetch(`data/${c.name}.json`)).json());
  const [step, model] = [await bytes(`data/${m.files.step.name}`), await bytes(`data/${m.files.model.name}`)];
  const trainer = await Trainer.create(ort, m, step, model);
  const nin = m.inputs[0].shape[1], classes = 10, rand = rng(1);
  const batches = Array.from({length: 4}, () => {
    const x = Float32Array.from({length: c.batch * nin}, () => rand());
    const y = Array.from({length: c.batch}, () => Math.floor(rand() * classes));
    return {x, y};
  });
  const ortFeeds = batches.map(({x, y}) => ({
    [m.inputs[0].name]: new ort.Tensor('float32', x, [c.batch, nin]),
    [m.targets[0].name]: new ort.Tensor('int64', BigInt64Array.from(y, BigInt), [c.batch])}));

  // TensorFlow.js: the same MLP from the same initial weights, in its own best form: a dense
  // layer's kernel [in, out] (x @ W), the ONNX weight [out, in] transposed once
  const init = {};
  for (const p of m.params) init[p.name] = new Float32Array(new Uint8Array(model, p.offset, p.length).slice().buffer);
  const shape = name => m.params.find(p => p.name === name).shape;
  const vars = c.layers.map(([w, b]) => [
    tf.variable(tf.tidy(() => tf.transpose(tf.tensor(init[w], shape(w))))),
    tf.variable(tf.tensor(init[b], shape(b)))]);
  const tfData = batches.map(({x, y}) => [tf.tensor2d(x, [c.batch, nin]), tf.oneHot(tf.tensor1d(y, 'int32'), classes)]);
  const opt = tf.train.adam(c.lr, 0.9, 0.999, 1e-8);
  const forward = x => vars.reduce((h, [w, b], i) => {
    const z = tf.add(tf.matMul(h, w), b);
    return i < vars.length - 1 ? tf.relu(z) : z;
  }, x);
  const tfStep = k => {
    const [x, y] = tfData[k % tfData.length];
    const loss = opt.minimize(() => tf.losses.softmaxCrossEntropy(y, forward(x)), true, vars.flat());
    const v = loss.dataSync()[0];
    loss.dispose();
    return v;
  };
  const ortStep = async k => trainer.step(ortFeeds[k % ortFeeds.length], c.lr);

  // the two sides compute the same loss from the same start
  const first = {onnxgrad: await ortStep(0), tfjs: tfStep(0)};
  const windows = {onnxgrad: [], tfjs: []};
  let k = 1;
  for (let i = 0; i < c.warmup; i++, k++) { await ortStep(k); tfStep(k); }
  for (let r = 0; r < c.rounds; r++) {
    let t0 = performance.now();
    for (let i = 0; i < c.steps; i++) await ortStep(k + i);
    windows.onnxgrad.push(c.steps / ((performance.now() - t0) / 1000));
    t0 = performance.now();
    for (let i = 0; i < c.steps; i++) tfStep(k + i);
    windows.tfjs.push(c.steps / ((performance.now() - t0) / 1000));
    k += c.steps;
  }
  tf.dispose([vars.flat(), tfData.flat()]);
  opt.dispose();
  trainer.dispose();
  await trainer.session.release();
  return {name: c.name, first, windows, onnxgrad: median(windows.onnxgrad), tfjs: median(windows.tfjs)};
}

async function main() {
  tf.wasm.setWasmPaths(new URL('node_modules/@tensorflow/tfjs-backend-wasm/dist/', import.meta.url).href);
  tf.wasm.setThreadsCount(threads);
  if (!await tf.setBackend('wasm')) throw new Error('TensorFlow.js: no WASM backend');
  await tf.ready();
  const env = {threads, isolated: self.crossOriginIsolated, tfjs: tf.version.tfjs,
               tfjsThreadsReported: tf.wasm.getThreadsCount(), ort: ort.env.versions.web, userAgent: navigator.userAgent};
  const results = [];
  for (const c of cases) results.push(await runCase(c));
  return {env, results};
}

main().then(r => { window.result = r; }, e => { window.result = {error: String(e.stack || e)}; });
