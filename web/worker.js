// The page's Web Worker: loads onnxruntime-web and a train step, trains it on the bundled digits,
// and answers the page (app.js), so the page stays responsive while it trains.
import {InputError, Trainer, checkManifest, numbers, pickExport} from './trainer.js';

const DIST = new URL('node_modules/onnxruntime-web/dist/', import.meta.url).href;
// ort.wasm: the CPU build with every kernel type; ort.webgpu: WebGPU plus a CPU build without
// float64 kernels (web steps keep their scalars in float32 for it)
const BUNDLES = {wasm: 'ort.wasm.min.mjs', webgpu: 'ort.webgpu.min.mjs'};
const SELF_CHECK_TOLERANCE = 1e-3;

let ort, trainer, data, predictor = null, predictorStep = -1, stop = false;
const post = (msg, transfer) => self.postMessage(msg, transfer || []);

async function loadOrt(backend, threads) {
  const mod = await import(DIST + BUNDLES[backend]);
  mod.env.wasm.wasmPaths = DIST;
  mod.env.wasm.numThreads = threads;
  mod.env.logLevel = 'error';
  return mod;
}

async function fetchBytes(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.arrayBuffer();
}

/** digits.bin (see web/make_assets.py) -> {train: {x, y, n}, val: {x, y, n}, features}. */
function parseDigits(buf) {
  const magic = new TextDecoder().decode(new Uint8Array(buf, 0, 8));
  if (magic !== 'OGDIGIT1') throw new Error('assets/digits.bin is not a digits file');
  const [nTrain, nVal, features, classes] = new Uint32Array(buf.slice(8, 24));
  const px = new Uint8Array(buf, 24, (nTrain + nVal) * features);
  const labels = new Uint8Array(buf, 24 + px.length, nTrain + nVal);
  const x = Float32Array.from(px, v => v / 16);
  const part = (a, b) => ({x: x.subarray(a * features, b * features), y: labels.subarray(a, b), n: b - a});
  return {train: part(0, nTrain), val: part(nTrain, nTrain + nVal), features, classes};
}

/** The step must read the digits: one float input [N, 64], int labels [N], cross-entropy. */
function checkFitsDigits(m) {
  const [x] = m.inputs, [t] = m.targets;
  const ok = m.inputs.length === 1 && m.targets.length === 1 && x.dtype === 'float32' &&
    x.shape.length === 2 && x.shape[1] === data.features && ['int64', 'int32'].includes(t.dtype) &&
    t.shape.length === 1 && m.loss.kind === 'cross_entropy';
  if (!ok) {
    const shown = [...m.inputs, ...m.targets].map(i => `${i.name} ${i.dtype} [${i.shape}]`).join(', ');
    throw new InputError(`this page trains on its digits (x float32 [N, ${data.features}], labels int64 [N]) ` +
      `with the cross_entropy loss; this step reads ${shown} with loss ${m.loss.kind || m.loss.name}`);
  }
}

function batch(m, part, rows) {
  const f = data.features;
  const x = new Float32Array(rows.length * f);
  rows.forEach((r, i) => x.set(part.x.subarray(r * f, (r + 1) * f), i * f));
  const t = m.targets[0];
  const y = t.dtype === 'int64' ? BigInt64Array.from(rows, r => BigInt(part.y[r])) : Int32Array.from(rows, r => part.y[r]);
  return {[m.inputs[0].name]: new ort.Tensor('float32', x, [rows.length, f]),
          [t.name]: new ort.Tensor(t.dtype, y, [rows.length])};
}

const range = (a, b) => Array.from({length: b - a}, (_, i) => a + i);

async function init({backend, threads, files}) {
  trainer?.dispose();
  trainer = null;
  predictor = null;
  ort = await loadOrt(backend, threads);
  data = data || parseDigits(await fetchBytes('assets/digits.bin'));
  let exp;
  if (files) {
    exp = await pickExport(ort, files);
  } else {
    const manifest = checkManifest(JSON.parse(new TextDecoder().decode(await fetchBytes('assets/digits_step.json'))));
    exp = {manifest, step: await fetchBytes('assets/' + manifest.files.step.name),
           model: await fetchBytes('assets/' + manifest.files.model.name)};
  }
  checkFitsDigits(exp.manifest);
  let note = '';
  if (backend === 'webgpu') {
    [trainer, note] = await selfChecked(exp);
    if (!trainer) {  // train on the plain WASM build, faster than the WebGPU bundle's CPU one
      ort = await loadOrt('wasm', threads);
      trainer = await Trainer.create(ort, exp.manifest, exp.step, exp.model, {executionProviders: ['wasm']});
    }
  } else {
    trainer = await Trainer.create(ort, exp.manifest, exp.step, exp.model, {executionProviders: ['wasm']});
  }
  const m = exp.manifest;
  const count = m.params.reduce((a, p) => a + p.shape.reduce((x, d) => x * d, 1), 0);
  return {type: 'ready', backend: trainer.gpu ? 'webgpu' : 'wasm', threads: ort.env.wasm.numThreads,
          isolated: self.crossOriginIsolated, params: count, optimizer: m.optimizer, lr: m.lr.default,
          model: m.files.model.name, rows: {train: data.train.n, val: data.val.n}, note};
}

/** WebGPU kernels can be missing or wrong for an op (seen with onnxruntime-web 1.30: LSTM steps
 * off by 40x on its JSEP build): take one step on WebGPU and on WASM from the same start, and
 * train on WebGPU only when the two agree. Resolves to [trainer or null (use WASM), note]. */
async function selfChecked(exp) {
  let gpu;
  try {
    gpu = await Trainer.create(ort, exp.manifest, exp.step, exp.model, {executionProviders: ['webgpu', 'wasm']});
  } catch (e) {
    return [null, `WebGPU was not used: it cannot run this step (${e.message}). Training on WASM`];
  }
  const cpu = await Trainer.create(ort, exp.manifest, exp.step, exp.model);
  const rows = range(0, Math.min(32, data.train.n));
  let why = null;
  try {
    const lr = exp.manifest.lr.default;
    const [a, b] = [await gpu.step(batch(gpu.m, data.train, rows), lr), await cpu.step(batch(cpu.m, data.train, rows), lr)];
    const pa = await gpu.parameters(), pb = await cpu.parameters();
    let worst = Math.abs(a - b) / Math.abs(b), where = 'loss';
    for (const k of Object.keys(pb)) {
      let d = 0, s = 0;
      for (let i = 0; i < pb[k].length; i++) {
        d = Math.max(d, Math.abs(pa[k][i] - pb[k][i]));
        s = Math.max(s, Math.abs(pb[k][i]));
      }
      if (!(d / s <= worst)) [worst, where] = [d / s, k];
    }
    if (!(worst <= SELF_CHECK_TOLERANCE)) why = `its first step differs from WASM's by ${worst.toExponential(1)} (relative, in ${where})`;
  } catch (e) {
    why = `it failed on the first step (${e.message})`;
  }
  cpu.dispose();
  await cpu.session.release();
  if (why) {
    gpu.dispose();
    await gpu.session.release();
    return [null, `WebGPU was not used: ${why}. Training on WASM`];
  }
  gpu.reset();
  return [gpu, 'WebGPU agrees with WASM on the first step'];
}

function mulberry32(seed) {
  return () => {
    seed = (seed + 0x6D2B79F5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function shuffled(n, rand) {
  const a = Uint32Array.from(range(0, n));
  for (let i = n - 1; i > 0; i--) {
    const j = Math.floor(rand() * (i + 1));
    [a[i], a[j]] = [a[j], a[i]];
  }
  return a;
}

/** Logits of `part` from the downloadable model (the bytes "download" gives). */
async function logits(part) {
  if (predictorStep !== trainer.stepCount || !predictor) {
    await predictor?.release();
    predictor = await trainer.predictor();
    predictorStep = trainer.stepCount;
  }
  const m = trainer.m;
  const x = new ort.Tensor('float32', Float32Array.from(part.x), [part.n, data.features]);
  const out = await predictor.run({[m.inputs[0].name]: x});
  return numbers(out[m.loss.output]);
}

/** Mean cross-entropy and accuracy of the downloadable model on `part`. */
async function evaluate(part) {
  const z = await logits(part), c = data.classes;
  let loss = 0, right = 0;
  for (let i = 0; i < part.n; i++) {
    const row = z.subarray(i * c, (i + 1) * c);
    const top = Math.max(...row);
    const lse = top + Math.log(row.reduce((a, v) => a + Math.exp(v - top), 0));
    loss += lse - row[part.y[i]];
    right += row.indexOf(top) === part.y[i];
  }
  return {loss: loss / part.n, accuracy: right / part.n};
}

const tick = () => new Promise(r => setTimeout(r, 0));

async function train({epochs, batchSize, lr, seed}) {
  stop = false;
  const rand = mulberry32(seed >>> 0);
  const n = data.train.n, per = Math.ceil(n / batchSize);
  let busy = 0, steps = 0, losses = [], lastPost = performance.now(), lastTick = lastPost;
  for (let e = 0; e < epochs && !stop; e++) {
    const order = shuffled(n, rand);
    for (let b = 0; b < per && !stop; b++) {
      const rows = Array.from(order.subarray(b * batchSize, (b + 1) * batchSize));
      const feeds = batch(trainer.m, data.train, rows);
      const t0 = performance.now();
      const loss = await trainer.step(feeds, lr);
      const t1 = performance.now();
      busy += t1 - t0;
      steps++;
      losses.push(loss);
      if (t1 - lastPost > 50 || b === per - 1) {  // the losses of every step, a few posts a second
        post({type: 'progress', step: trainer.stepCount, epoch: e + (b + 1) / per, losses,
              stepsPerSec: steps / (busy / 1000)});
        losses = [];
        lastPost = t1;
      }
      if (t1 - lastTick > 50) { await tick(); lastTick = performance.now(); }  // let "stop" in
    }
    if (losses.length) {  // stopped between posts
      post({type: 'progress', step: trainer.stepCount, epoch: e + 1, losses, stepsPerSec: steps / (busy / 1000)});
      losses = [];
    }
    const val = await evaluate(data.val);
    post({type: 'epoch', epoch: e + 1, step: trainer.stepCount, valLoss: val.loss, valAccuracy: val.accuracy});
  }
  return {type: 'done', step: trainer.stepCount, stepsPerSec: steps / (busy / 1000), stopped: stop};
}

/** Steps on fixed batches (training rows k*b .. (k+1)*b - 1 in file order) from the initial
 * parameters, for comparing with onnxruntime in Python. */
async function fixedSteps({steps, batchSize, lr}) {
  trainer.reset();
  const losses = [];
  for (let k = 0; k < steps; k++) losses.push(await trainer.step(batch(trainer.m, data.train, range(k * batchSize, (k + 1) * batchSize)), lr));
  const params = await trainer.parameters();
  return {type: 'fixed-steps', losses, params: Object.fromEntries(Object.entries(params).map(([k, v]) => [k, Array.from(v)]))};
}

async function predict({pixels}) {
  const z = await logits({x: pixels, n: 1});
  const top = Math.max(...z);
  const e = Array.from(z, v => Math.exp(v - top));
  const s = e.reduce((a, v) => a + v, 0);
  return {type: 'prediction', probs: e.map(v => v / s)};
}

async function download() {
  const bytes = await trainer.modelBytes();
  return [{type: 'model', name: trainer.m.files.model.name.replace(/\.model\.onnx$/, '') + '_trained.onnx',
           bytes: bytes.buffer}, [bytes.buffer]];
}

const HANDLERS = {init, train, fixedSteps, predict, download};

self.onmessage = async ({data: msg}) => {
  if (msg.type === 'stop') { stop = true; return; }
  try {
    const res = await HANDLERS[msg.type](msg);
    const [reply, transfer] = Array.isArray(res) ? res : [res];
    post({...reply, id: msg.id}, transfer);
  } catch (e) {
    post({type: 'error', id: msg.id, message: String(e.message || e), input: e instanceof InputError});
  }
};
