"""Hugging Face encoder-decoders (BART, Marian, Pegasus, T5), as a user exports them, against
torch autograd, with the decoder's length other than the encoder's.

    pip install transformers          # not in the test extras
    python bench/hf_encoder_decoder.py                    # every model, both exporters
    python bench/hf_encoder_decoder.py bart --ort-optimized

Each model is built from a small random config (1 layer each side, width 32; nothing is
downloaded), every parameter nudged by 0.02 N(0, 1) (bench/hf_models.py says why), in eval mode.
f = sum(last_hidden_state * c) of the decoder, from input_ids [B, S] with a padding mask and
decoder_input_ids [B, T]. It is exported with symbolic B, S and T (the TorchScript exporter at
opset 17, and the dynamo exporter with dynamic shapes), optionally saved by onnxruntime after its
graph optimizations (``--ort-optimized``: SkipLayerNormalization, BiasGelu, FusedMatMul), and
differentiated with respect to every float initializer. The gradients are compared with torch's
at two (S, T) pairs, (8, 5) and (6, 9), each torch parameter with the sum of ours over the
initializers that hold its bytes (as they are, or transposed); a gradient below 1e-3 of the
largest one (an attention key bias: exactly 0 up to rounding) is measured against that floor.
Frozen parameters (Marian's and Pegasus' sinusoidal positions: torch computes no gradient for
them; ours is the derivative with respect to that initializer all the same) are not compared.

An encoder and a decoder of different lengths are what made onnx's made-up dim names (unk__N,
one numbering per inference run) collide in the gradient model before session 11.
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import re
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_models import TOL, nudged, ort_optimized, params_by_bytes  # noqa: E402

D = 32


def models(T) -> dict:
    def seq2seq(cls, **kw):
        return cls(**{**dict(d_model=D, encoder_layers=1, decoder_layers=1,
                             encoder_attention_heads=2, decoder_attention_heads=2,
                             encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                             max_position_embeddings=64), **kw})
    return {
        "bart": lambda: T.BartModel(seq2seq(T.BartConfig)),
        "marian": lambda: T.MarianModel(seq2seq(T.MarianConfig, pad_token_id=1,
                                                decoder_start_token_id=1)),
        "pegasus": lambda: T.PegasusModel(seq2seq(T.PegasusConfig)),
        "t5": lambda: T.T5Model(T.T5Config(d_model=D, d_kv=16, d_ff=64, num_layers=1,
                                           num_decoder_layers=1, num_heads=2, vocab_size=100)),
    }


def check(make, dynamo: bool, optimized: bool) -> dict:
    import onnx
    import torch

    import onnxgrad
    from fuzz_cases import quiet_session as session  # stock onnxruntime, as users run it

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, am, c, dids):
            out = self.m(input_ids=ids, attention_mask=am, decoder_input_ids=dids)
            return (out.last_hidden_state * c).sum()

    w = Wrap(nudged(make)).eval()

    def inputs(s, t):
        ids, dids = torch.randint(2, 100, (2, s)), torch.randint(2, 100, (2, t))
        am = torch.ones(2, s, dtype=torch.int64)
        am[1, s - 2:] = 0
        return ids, am, torch.randn(2, t, D), dids

    names = ["ids", "am", "c", "dids"]
    args = inputs(8, 5)
    if dynamo:
        b, s, t = (torch.export.Dim(k, min=1 if k == "b" else 2, max=32) for k in "bst")
        model = torch.onnx.export(w, args, dynamo=True, input_names=names, output_names=["loss"],
                                  dynamic_shapes={"ids": {0: b, 1: s}, "am": {0: b, 1: s},
                                                  "c": {0: b, 1: t}, "dids": {0: b, 1: t}},
                                  verbose=False).model_proto
    else:
        f = io.BytesIO()
        torch.onnx.export(w, args, f, dynamo=False, opset_version=17, input_names=names,
                          output_names=["loss"], do_constant_folding=False,
                          dynamic_axes={"ids": {0: "b", 1: "s"}, "am": {0: "b", 1: "s"},
                                        "c": {0: "b", 1: "t"}, "dids": {0: "b", 1: "t"}})
        model = onnx.load_from_string(f.getvalue())
    if optimized:
        model = ort_optimized(model)
    inits = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    res = onnxgrad.gradients(model, "loss", [t.name for t in inits])
    onnx.checker.check_model(res.model, full_check=True)
    params = dict(w.named_parameters())
    by_bytes = params_by_bytes(params)
    grads = [g for g in res.grads if g is not None]
    sess, worst, forward = session(res.model), (0.0, "-"), 0.0
    for s, t in ((8, 5), (6, 9)):
        args = inputs(s, t)
        ours = dict(zip(["loss", *grads], sess.run(["loss", *grads], dict(
            zip(names, (a.numpy() for a in args))))))
        w.zero_grad()
        loss = w(*args)
        loss.backward()
        forward = max(forward, abs(float(ours["loss"]) - float(loss)) / abs(float(loss)))
        scale = max(float(p.grad.abs().max()) for p in params.values() if p.grad is not None)
        sums = {}
        for init, g in zip(inits, res.grads):
            a = onnx.numpy_helper.to_array(init)
            hit = by_bytes.get((a.shape, a.tobytes()))
            if hit is None or g is None:
                continue
            pname, transposed = hit
            mine = ours[g].T if transposed else ours[g]
            sums[pname] = sums.get(pname, 0) + mine
        sums = {k: v for k, v in sums.items() if params[k].requires_grad}
        for pname, mine in sums.items():
            want = params[pname].grad
            want = np.zeros(mine.shape, np.float32) if want is None else want.numpy()
            err = float(np.abs(mine - want).max() / max(np.abs(want).max(), 1e-3 * scale))
            worst = max(worst, (err, pname))
    return dict(forward=forward, worst=worst, compared=len(sums), params=len(params),
                ops=sorted({n.op_type for n in model.graph.node if n.domain == "com.microsoft"}))


def row(cells: list, r: dict) -> tuple[str, bool]:
    """The table row of a check's result ``r`` after the leading ``cells``, and whether the
    forward and every compared parameter agree with torch."""
    ok = r["forward"] < TOL and r["worst"][0] < TOL
    return (f"| {' | '.join(cells)} | {', '.join(r['ops'])} | {r['forward']:.0e} | "
            f"{r['worst'][0]:.0e} ({r['worst'][1]}) | {r['compared']} / {r['params']} | "
            f"{'ok' if ok else 'MISMATCH'} |"), ok


def main(argv=None) -> int:
    import transformers as T
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    makers = models(T)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help=f"any of {', '.join(makers)}")
    p.add_argument("--exporter", choices=["ts", "dynamo", "both"], default="both")
    p.add_argument("--ort-optimized", action="store_true",
                   help="as onnxruntime saves it after its graph optimizations")
    args = p.parse_args(argv)
    print("| model | exporter | onnxruntime's ops | forward | worst parameter | compared / "
          "parameters | verdict |")
    print("|---|---|---|---:|---:|---:|---|")
    bad = 0
    for dynamo in {"ts": [False], "dynamo": [True], "both": [False, True]}[args.exporter]:
        for name, make in makers.items():
            if args.models and name not in args.models:
                continue
            exp = ("dynamo" if dynamo else "TorchScript") + (
                " + onnxruntime optimizer" if args.ort_optimized else "")
            try:
                r = check(make, dynamo, args.ort_optimized)
            except Exception as err:  # a refusal, a crash or an exporter's failure: go on
                ours = not type(err).__module__.startswith("torch")
                bad += ours
                text = re.sub(r"\x1b\[[0-9;]*m", "", str(err).splitlines()[0])[:120]
                print(f"| {name} | {exp} | | | | | {'' if ours else 'not exported: '}"
                      f"{type(err).__name__}: {text} |", flush=True)
                continue
            line, ok = row([name, exp], r)
            bad += not ok
            print(line, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
