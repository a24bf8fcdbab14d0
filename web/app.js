// The page: controls, the loss chart and the drawing pad. The training runs in worker.js.
const $ = id => document.getElementById(id);
let worker, nextId = 0, pending = new Map(), ready = false, training = false;
const history = {train: [], val: []};  // [step, loss]; val also per epoch
let stepsPerEpoch = 1;

function say(text, kind = 'info') {
  const m = $('message');
  m.textContent = text;
  m.className = kind === 'error' ? 'error' : '';
  m.dataset.state = kind;
}

function request(msg, transfer) {
  const id = ++nextId;
  return new Promise((resolve, reject) => {
    pending.set(id, {resolve, reject});
    worker.postMessage({...msg, id}, transfer || []);
  });
}

function onMessage({data: msg}) {
  if (msg.type === 'progress') return progress(msg);
  if (msg.type === 'epoch') return epoch(msg);
  const p = pending.get(msg.id);
  if (!p) return;
  pending.delete(msg.id);
  if (msg.type === 'error') {
    const e = new Error(msg.message);
    e.input = msg.input;
    p.reject(e);
  } else {
    p.resolve(msg);
  }
}

function buttons() {
  $('train').disabled = !ready || training;
  $('stop').disabled = !training;
  $('download').disabled = !ready || training;
  $('files').disabled = training;
  $('backend').disabled = training;
  $('threads').disabled = training || !self.crossOriginIsolated;
  $('source').disabled = training;
}

/** A fresh worker loading the bundled step or the files given ([{name, bytes}]). */
async function load(files) {
  worker?.terminate();
  for (const p of pending.values()) p.reject(new Error('reloaded'));
  pending = new Map();
  ready = false;
  buttons();
  history.train = [];
  history.val = [];
  draw();
  worker = new Worker('worker.js', {type: 'module'});
  worker.onmessage = onMessage;
  worker.onerror = e => say(`the worker failed: ${e.message}`, 'error');
  const backend = $('backend').value;
  const threads = self.crossOriginIsolated ? Math.max(1, Math.floor(+$('threads').value) || 1) : 1;
  say(`Loading ${files ? 'your files' : 'the digits MLP'} on ${backend}…`);
  try {
    const info = await request({type: 'init', backend, threads, files}, files ? files.map(f => f.bytes) : []);
    ready = true;
    app.info = info;
    $('lr').value = info.lr;
    $('info').textContent = `${info.model}: ${info.params.toLocaleString()} parameters, ${info.optimizer.type}; ` +
      `${info.rows.train} training and ${info.rows.val} validation digits; onnxruntime-web ${info.backend}` +
      (info.backend === 'wasm' ? `, ${info.threads} thread${info.threads > 1 ? 's' : ''}` +
        (info.isolated ? '' : ' (no cross-origin isolation: one thread)') : '');
    say((info.note ? info.note + '. ' : '') + 'Ready: press Train.', info.note && info.note.startsWith('WebGPU was not') ? 'warn' : 'ready');
  } catch (e) {
    say(e.message, 'error');
  }
  buttons();
}

function progress(msg) {
  const first = msg.step - msg.losses.length + 1;
  msg.losses.forEach((v, i) => history.train.push([first + i, v]));
  const recent = history.train.slice(-stepsPerEpoch).map(p => p[1]);
  $('s-step').textContent = msg.step;
  $('s-rate').textContent = msg.stepsPerSec.toFixed(0);
  $('s-loss').textContent = (recent.reduce((a, v) => a + v, 0) / recent.length).toFixed(3);
  draw();
}

function epoch(msg) {
  history.val.push([msg.step, msg.valLoss]);
  $('s-acc').textContent = (100 * msg.valAccuracy).toFixed(1) + ' %';
  app.epochs.push(msg);
  draw();
  say(`Epoch ${msg.epoch}: validation loss ${msg.valLoss.toFixed(4)}, accuracy ${(100 * msg.valAccuracy).toFixed(1)} %`, 'training');
}

async function train() {
  const epochs = Math.max(1, Math.floor(+$('epochs').value)), batchSize = Math.max(1, Math.floor(+$('batch').value));
  const lr = +$('lr').value;
  if (!(lr >= 0)) return say(`the learning rate ${$('lr').value} is not a number >= 0`, 'error');
  training = true;
  buttons();
  app.epochs = [];
  stepsPerEpoch = Math.ceil(app.info.rows.train / batchSize);
  $('s-step').textContent = '0';  // not the step count of a model loaded before this one
  say('Training…', 'training');
  try {
    const done = await request({type: 'train', epochs, batchSize, lr, seed: 0});
    const last = app.epochs[app.epochs.length - 1];
    say(`${done.stopped ? 'Stopped' : 'Done'} after ${done.step} steps (${done.stepsPerSec.toFixed(0)} steps/s)` +
      (last ? `: validation accuracy ${(100 * last.valAccuracy).toFixed(1)} %` : '') + '. Draw a digit.', 'done');
  } catch (e) {
    say(e.message, 'error');
  }
  training = false;
  buttons();
  if (padHasInk) predict();
}

async function download() {
  const {name, bytes} = await request({type: 'download'});
  const a = document.createElement('a');
  a.href = URL.createObjectURL(new Blob([bytes], {type: 'application/octet-stream'}));
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

// -- the loss chart ---------------------------------------------------------------------------
function draw() {
  const c = $('chart'), g = c.getContext('2d'), W = c.width, H = c.height;
  const L = 52, R = 12, T = 12, B = 34;
  g.clearRect(0, 0, W, H);
  g.font = '12px system-ui, sans-serif';
  const pts = [...history.train, ...history.val];
  const maxStep = Math.max(stepsPerEpoch, ...pts.map(p => p[0]));
  const ys = pts.map(p => p[1]).filter(v => v > 0);
  let lo = Math.log10(Math.min(...ys, 1)), hi = Math.log10(Math.max(...ys, 2.5));
  lo = Math.floor(lo * 2) / 2;
  hi = Math.ceil(hi * 2) / 2;
  const X = s => L + (W - L - R) * s / maxStep, Y = v => T + (H - T - B) * (hi - Math.log10(Math.max(v, 1e-9))) / (hi - lo);
  g.strokeStyle = '#e4e7ec';
  g.fillStyle = '#667085';
  g.lineWidth = 1;
  for (let e = lo; e <= hi + 1e-9; e += 0.5) {
    g.beginPath(); g.moveTo(L, Y(10 ** e)); g.lineTo(W - R, Y(10 ** e)); g.stroke();
    g.fillText((10 ** e).toPrecision(2).replace(/\.0+$/, ''), 6, Y(10 ** e) + 4);
  }
  g.fillText('loss (log scale) against steps', L, H - 6);
  g.fillText(String(maxStep), W - R - 24, H - 20);
  const line = (data, color, dots) => {
    if (!data.length) return;
    g.strokeStyle = g.fillStyle = color;
    g.lineWidth = dots ? 2 : 1;
    g.beginPath();
    data.forEach(([s, v], i) => (i ? g.lineTo(X(s), Y(v)) : g.moveTo(X(s), Y(v))));
    g.stroke();
    if (dots) for (const [s, v] of data) { g.beginPath(); g.arc(X(s), Y(v), 3.5, 0, 7); g.fill(); }
  };
  line(history.train, '#2e6fdb', false);
  line(history.val, '#e0631b', true);
  g.fillStyle = '#2e6fdb'; g.fillRect(W - 190, 16, 12, 3); g.fillText('train (each step)', W - 172, 21);
  g.fillStyle = '#e0631b'; g.fillRect(W - 190, 32, 12, 3); g.fillText('validation (per epoch)', W - 172, 37);
}

// -- the drawing pad --------------------------------------------------------------------------
const pad = $('pad'), pen = pad.getContext('2d');
let padHasInk = false, last = null;

function clearPad() {
  pen.fillStyle = '#fff';
  pen.fillRect(0, 0, pad.width, pad.height);
  padHasInk = false;
  $('prediction').textContent = '–';
  $('bars').innerHTML = '';
  $('thumb').getContext('2d').clearRect(0, 0, 8, 8);
}

function stroke(e) {
  const r = pad.getBoundingClientRect();
  const p = [(e.clientX - r.left) * pad.width / r.width, (e.clientY - r.top) * pad.height / r.height];
  pen.strokeStyle = '#000';
  pen.lineWidth = 20;
  pen.lineCap = pen.lineJoin = 'round';
  pen.beginPath();
  pen.moveTo(...(last || p));
  pen.lineTo(...p);
  pen.stroke();
  last = p;
  padHasInk = true;
}

/** The drawing as scikit-learn's digits: the ink's bounding box scaled into a 32x32 bitmap (20
 * pixels on its long side, centred), then the ink count of each 4x4 block (0..16) / 16. */
function features() {
  const W = pad.width, img = pen.getImageData(0, 0, W, W).data;
  let x0 = W, y0 = W, x1 = -1, y1 = -1;
  for (let y = 0; y < W; y++) for (let x = 0; x < W; x++) {
    if (img[(y * W + x) * 4] < 128) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
  }
  const out = new Float32Array(64);
  if (x1 < 0) return out;
  const side = Math.max(x1 - x0, y1 - y0) + 1, scale = 24 / side;
  const small = new OffscreenCanvas(32, 32), s = small.getContext('2d');
  s.fillStyle = '#fff';
  s.fillRect(0, 0, 32, 32);
  s.imageSmoothingQuality = 'high';
  const w = (x1 - x0 + 1) * scale, h = (y1 - y0 + 1) * scale;
  s.drawImage(pad, x0, y0, x1 - x0 + 1, y1 - y0 + 1, (32 - w) / 2, (32 - h) / 2, w, h);
  const bits = s.getImageData(0, 0, 32, 32).data;
  for (let y = 0; y < 32; y++) for (let x = 0; x < 32; x++) {
    if (bits[(y * 32 + x) * 4] < 160) out[(y >> 2) * 8 + (x >> 2)] += 1 / 16;
  }
  return out;
}

async function predict() {
  if (!ready || training || !padHasInk) return;
  const pixels = features();
  app.lastFeatures = Array.from(pixels);
  const t = $('thumb').getContext('2d'), im = t.createImageData(8, 8);
  pixels.forEach((v, i) => { im.data.set([255 * (1 - v), 255 * (1 - v), 255 * (1 - v), 255], i * 4); });
  t.putImageData(im, 0, 0);
  try {
    const {probs} = await request({type: 'predict', pixels});
    const k = probs.indexOf(Math.max(...probs));
    app.lastPrediction = {digit: k, probs};
    $('prediction').textContent = k;
    $('bars').innerHTML = probs.map((p, i) => `<div data-k="${i}" style="height:${Math.max(1, 60 * p)}px"></div>`).join('');
  } catch (e) {
    say(e.message, 'error');
  }
}

pad.addEventListener('pointerdown', e => { pad.setPointerCapture(e.pointerId); last = null; stroke(e); });
pad.addEventListener('pointermove', e => { if (e.buttons) stroke(e); });
pad.addEventListener('pointerup', () => { last = null; predict(); });

// -- wiring -----------------------------------------------------------------------------------
async function chooseFiles() {
  const list = [...$('files').files];
  if (!list.length) return;
  const files = await Promise.all(list.map(async f => ({name: f.name, bytes: await f.arrayBuffer()})));
  $('source').options[1].disabled = false;
  $('source').value = 'files';
  app.files = files;
  await load(files.map(f => ({name: f.name, bytes: f.bytes.slice(0)})));
}

$('train').onclick = train;
$('stop').onclick = () => worker.postMessage({type: 'stop'});
$('download').onclick = () => download().catch(e => say(e.message, 'error'));
$('clear').onclick = clearPad;
$('files').onchange = () => chooseFiles().catch(e => say(e.message, 'error'));
// WASM threads need cross-origin isolation (onnxgrad web sends the headers); small models may
// train faster on fewer threads than cores, big ones on all of them
$('threads').value = $('threads').max = self.crossOriginIsolated ? navigator.hardwareConcurrency || 1 : 1;
$('backend').onchange = $('source').onchange = $('threads').onchange = () =>
  load($('source').value === 'files' && app.files ? app.files.map(f => ({name: f.name, bytes: f.bytes.slice(0)})) : null);
if (!navigator.gpu) { $('backend').options[1].disabled = true; $('backend').options[1].textContent = 'WebGPU (not offered)'; }

// for scripts that drive the page (tests, benchmarks)
const app = window.app = {
  epochs: [],
  history,
  loaded: null,
  fixedSteps: (steps, batchSize, lr) => request({type: 'fixedSteps', steps, batchSize, lr}),
};
clearPad();
draw();
app.loaded = load(null);
