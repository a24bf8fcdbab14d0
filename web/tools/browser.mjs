// Headless Chromium for the tests and the benchmark: Debian's /usr/bin/chromium (or
// $CHROMIUM) driven by playwright-core, with a fresh profile and no background connections
// (nothing is downloaded: no browser build, no component updates).
import {chromium} from 'playwright-core';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

export const FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync'];

/** {context, page, close}: a browser with its own temporary profile; `log` gets console lines. */
export async function launch({log = () => {}, webgpu = false, acceptDownloads = false} = {}) {
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'onnxgrad-chromium-'));
  const args = webgpu ? [...FLAGS.filter(f => f !== '--disable-gpu'), '--enable-unsafe-webgpu'] : FLAGS;
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium', headless: true, args,
    ignoreDefaultArgs: ['--enable-automation'], acceptDownloads, viewport: {width: 1240, height: 820}});
  const page = context.pages()[0] || await context.newPage();
  page.on('console', m => log(`[console.${m.type()}] ${m.text()}`));
  page.on('pageerror', e => log(`[pageerror] ${e.message}`));
  page.on('response', r => { if (r.status() >= 400) log(`[http ${r.status()}] ${r.url()}`); });
  const close = async () => {
    await context.close();
    fs.rmSync(profile, {recursive: true, force: true});
  };
  return {context, page, close};
}
