// onnxgrad's browser trainer: runs a train step exported by
//   onnxgrad export-train-step MODEL --loss .. --target web -o S.onnx
// on onnxruntime-web. Like the Python Trainer, it keeps the parameters, the optimizer state and
// the BatchNormalization running statistics as ort tensors and swaps them between steps: the
// step's outputs are the next step's inputs (on WebGPU they stay GPU buffers). The trained model
// is S.model.onnx with the parameters' and statistics' bytes overwritten in place: the original
// graph with the trained weights, as Trainer.export writes it.
// No DOM here: the module runs in a Web Worker (worker.js) and takes `ort` as an argument.

export const FORMAT = 'onnxgrad-web-step';
const ARRAYS = {float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
                int8: Int8Array, uint8: Uint8Array, bool: Uint8Array,
                float16: globalThis.Float16Array || Uint16Array};

/** IEEE half-precision bits as a number (onnxruntime-web gives float16 data as its bits, a
 * Uint16Array, where the JS engine has no Float16Array: Node 20, older browsers). */
function half(h) {
  const sign = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e === 31) return f ? NaN : sign * Infinity;
  return sign * (e ? (1 + f / 1024) * 2 ** (e - 15) : f * 2 ** -24);
}

/** A CPU tensor's values as numbers: float16 bits decoded (an inf loss is inf, not 31744). */
export function numbers(t) {
  return t.type === 'float16' && t.data instanceof Uint16Array ? Float32Array.from(t.data, half) : t.data;
}

/**
 * Options of every session this page makes. onnxruntime's GatherToSliceFusion rewrites
 * Range -> Gather as a Slice over Range's bounds and reads a negative bound as counted from the
 * end: Gather(x, Range(n - 1, -1, -1)), a reversal, came out empty, silently; its Pad_Fusion
 * folds a Pad of zeros into a MaxPool, whose pads are -inf; its NoopElimination takes a float64
 * factor within 6e-8 of 1 for 1 (onnxruntime-web 1.30 and Python 1.31 alike; onnxgrad's Python
 * sessions turn them off as well; the list is ';'-separated).
 */
export function sessionOptions(executionProviders = ['wasm'], more = {}) {
  return {executionProviders, ...more,
          extra: {optimization: {disable_specified_optimizers:
            'GatherToSliceFusion;Pad_Fusion;NoopElimination'}}};
}

/** A user-facing problem with the files given (shown as it is on the page). */
export class InputError extends Error {}

/** The manifest (parsed JSON), checked enough that later steps can trust its fields. */
export function checkManifest(m, what = 'the manifest') {
  if (!m || typeof m !== 'object' || m.format !== FORMAT) {
    throw new InputError(`${what} is not an onnxgrad web-step manifest (it has no "format": ` +
      `"${FORMAT}"): write one with onnxgrad export-train-step MODEL --loss .. --target web -o STEP.onnx`);
  }
  if (m.version !== 1) throw new InputError(`${what} has version ${m.version}; this page reads version 1`);
  for (const key of ['files', 'params', 'state', 'lr', 'step', 'loss', 'inputs', 'targets']) {
    if (!(key in m)) throw new InputError(`${what} has no "${key}"`);
  }
  for (const t of [...m.params, ...statsOf(m), ...m.state, ...m.inputs, ...m.targets]) {
    if (!(t.dtype in ARRAYS)) throw new InputError(`${what}: ${t.name} is ${t.dtype}, which this page cannot hold`);
  }
  return m;
}

export async function sha256(bytes) {
  const h = new Uint8Array(await crypto.subtle.digest('SHA-256', bytes));
  return Array.from(h, b => b.toString(16).padStart(2, '0')).join('');
}

/** null when onnxruntime-web reads `bytes` as an ONNX model, else its complaint. */
export async function notOnnx(ort, bytes) {
  try {
    const s = await ort.InferenceSession.create(new Uint8Array(bytes), sessionOptions());
    await s.release();
    return null;
  } catch (e) {
    return String(e.message || e);
  }
}

/**
 * The export among `files` ([{name, bytes}] the person chose): {manifest, step, model}, or an
 * InputError that says what is wrong (no manifest, a file that is not ONNX, a file of another export).
 */
export async function pickExport(ort, files) {
  const jsons = files.filter(f => f.name.toLowerCase().endsWith('.json'));
  const others = files.filter(f => !jsons.includes(f));
  const notModel = async f => {
    const why = await notOnnx(ort, f.bytes);
    return why && new InputError(`${f.name} is not an ONNX model (onnxruntime-web cannot read it: ${why.split('\n')[0]})`);
  };
  if (jsons.length !== 1) {
    for (const f of others) { const e = await notModel(f); if (e) throw e; }
    if (jsons.length > 1) throw new InputError('choose one manifest (.json) at a time');
    throw new InputError(`${others.map(f => f.name).join(', ') || 'the files chosen'}: no manifest. ` +
      'A train step for this page comes as three files: write them with onnxgrad export-train-step ' +
      'MODEL --loss cross_entropy --target web -o STEP.onnx, then choose STEP.json, STEP.onnx and STEP.model.onnx together');
  }
  let manifest;
  try {
    manifest = JSON.parse(new TextDecoder().decode(jsons[0].bytes));
  } catch (e) {
    throw new InputError(`${jsons[0].name} is not JSON (${e.message})`);
  }
  checkManifest(manifest, jsons[0].name);
  const got = {};
  for (const role of ['step', 'model']) {
    const want = manifest.files[role];
    const f = others.find(o => o.name === want.name);
    if (!f) throw new InputError(`${jsons[0].name} names ${want.name} as its ${role} file: choose it too`);
    if (f.bytes.byteLength !== want.bytes || await sha256(f.bytes) !== want.sha256) {
      throw (await notModel(f)) || new InputError(`${f.name} is not the file ${jsons[0].name} was written ` +
        'with (its size or SHA-256 differ): choose the three files that one export wrote together');
    }
    got[role] = f.bytes;
  }
  return {manifest, ...got};
}

const numel = shape => shape.reduce((a, d) => a * d, 1);
const statsOf = m => m.stats || [];  // a manifest without "stats": a step without statistics
// what the model file holds (read at reset, written by modelBytes), and what each step carries
const stored = m => [...m.params, ...statsOf(m)];
const carried = m => [...stored(m), ...m.state];

export function zeros(ort, t) {
  return new ort.Tensor(t.dtype, new ARRAYS[t.dtype](numel(t.shape)), t.shape);
}

/** The typed array for `n` values of `dtype` read from bytes[offset, offset + length). */
function readArray(bytes, offset, length, dtype) {
  const copy = new Uint8Array(bytes, offset, length).slice();  // aligned, owned
  return new ARRAYS[dtype](copy.buffer);
}

export class Trainer {
  /**
   * ort: the onnxruntime-web module; manifest: checked; step, model: ArrayBuffers of the files.
   * options.executionProviders (default ['wasm']).
   */
  static async create(ort, manifest, step, model, options = {}) {
    const eps = options.executionProviders || ['wasm'];
    const gpu = eps[0] === 'webgpu';
    const outputs = carried(manifest).map(t => t.output);
    const opts = sessionOptions(eps, {graphOptimizationLevel: 'all'});
    if (gpu) opts.preferredOutputLocation = Object.fromEntries(outputs.map(o => [o, 'gpu-buffer']));
    let session;
    try {
      session = await ort.InferenceSession.create(step, opts);
    } catch (e) {
      throw new InputError(`onnxruntime-web cannot load the step model: ${e.message || e}`);
    }
    return new Trainer(ort, manifest, session, model, gpu);
  }

  constructor(ort, manifest, session, model, gpu) {
    this.ort = ort;
    this.m = manifest;
    this.session = session;
    this.model = new Uint8Array(model);
    this.gpu = gpu;
    this.reset();
  }

  /** Back to the initial parameters and statistics (from the model file), zero state, step 1. */
  reset() {
    const {ort, m} = this;
    this.dispose();
    this.values = {};
    for (const p of stored(m)) {
      this.values[p.name] = new ort.Tensor(p.dtype, readArray(this.model.buffer, p.offset, p.length, p.dtype), p.shape);
    }
    for (const s of m.state) this.values[s.name] = zeros(ort, s);
    this.stepCount = 0;
  }

  /** One optimizer step on `batch` ({input name: ort.Tensor}); resolves to the loss. */
  async step(batch, lr) {
    const {ort, m} = this;
    const n = this.stepCount + 1;
    const feeds = {...batch, ...this.values};
    feeds[m.lr.name] = new ort.Tensor(m.lr.dtype, new ARRAYS[m.lr.dtype]([lr]), []);
    feeds[m.step.name] = new ort.Tensor('int64', new BigInt64Array([BigInt(n)]), []);
    const out = await this.session.run(feeds);
    const loss = numbers(out[m.loss.name])[0];
    if (!Number.isFinite(loss)) {
      for (const t of carried(m)) out[t.output].dispose?.();
      throw new Error(`the loss is ${loss} at step ${n}: training stopped (the updates of step ${n} ` +
        `were not applied; lower the learning rate)`);
    }
    const old = this.values;
    this.values = {};
    for (const t of carried(m)) this.values[t.name] = out[t.output];
    if (this.gpu) for (const t of Object.values(old)) if (t.location === 'gpu-buffer') t.dispose();
    this.stepCount = n;
    return loss;
  }

  /** The current parameters as typed arrays (copied from the GPU where they live there). */
  async parameters() {
    return this.arrays(this.m.params);
  }

  /** The current running statistics, as parameters() gives the parameters. */
  async statistics() {
    return this.arrays(statsOf(this.m));
  }

  async arrays(list) {
    const res = {};
    for (const p of list) {
      const t = this.values[p.name];
      res[p.name] = t.location === 'gpu-buffer' ? await t.getData() : t.data;
    }
    return res;
  }

  /** The model file with the current parameters and statistics: what "download" gives. */
  async modelBytes() {
    const bytes = this.model.slice();
    const values = await this.arrays(stored(this.m));
    for (const p of stored(this.m)) {
      const a = values[p.name];
      if (a.byteLength !== p.length) throw new Error(`${p.name}: ${a.byteLength} bytes, expected ${p.length}`);
      bytes.set(new Uint8Array(a.buffer, a.byteOffset, a.byteLength), p.offset);
    }
    return bytes;
  }

  /** An inference session of the current model (what download gives), on the CPU. */
  async predictor() {
    return this.ort.InferenceSession.create(await this.modelBytes(), sessionOptions());
  }

  dispose() {
    if (this.values && this.gpu) for (const t of Object.values(this.values)) if (t.location === 'gpu-buffer') t.dispose();
    this.values = null;
  }
}
