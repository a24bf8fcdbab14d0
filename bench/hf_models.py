"""Gradients of Hugging Face transformers models, as a user brings them, against torch autograd.

    pip install transformers          # not in the test extras: an optional, large dependency
    python bench/hf_models.py                     # every architecture, both exporters
    python bench/hf_models.py bert llama --exporter dynamo
    python bench/hf_models.py --ort-optimized     # as onnxruntime's optimizer saves them

Each architecture is built from a small random config (2 layers, width 32; images 32x32; no
pretrained weights, nothing is downloaded), every parameter nudged by 0.02 N(0, 1) so that no two
are equal (torch.onnx merges initializers with equal values, which a gradient then sums), in eval
mode with eager attention. The function is f = sum(out * c), out the model's last hidden state (the
logits for the segmentation head) and c a random cotangent; text models take ``inputs_embeds`` and
an int64 attention mask with padding in the second sequence, vision models the pixels. It is
exported with ``torch.onnx.export``: the TorchScript exporter at opset 17 without constant folding,
with symbolic batch and sequence dims (batch for images), checked at batch 3 and sequence 6
where it was exported at 2 and 8; the dynamo exporter at its defaults (static shapes), and ``onnxgrad.gradients(model, "loss", [x, *every float
initializer])`` runs on onnxruntime CPU in float32. Columns:

- forward: |loss(onnxruntime, exported model) - loss(torch)| / |loss(torch)|;
- dx: max |ours - torch| / max |torch| for the input gradient;
- params: the same for each initializer that is a torch parameter: under the same name with the
  same shape and bit-identical values, or under another name with the bytes of exactly one
  parameter or of its transpose (the dynamo exporter stores Linear weights transposed); the worst
  one is shown. Exporters fold some parameters
  (the dynamo exporter folds BatchNorm into Conv, Gemma's 1 + w): an initializer whose values
  differ from the parameter is another function of it and is not compared ("folded"). A tensor
  whose torch gradient is below 1e-3 of the model's largest one (an attention key bias, whose
  gradient is exactly 0 up to rounding) is compared against that floor instead;
- fd: the input gradient along one random direction against central differences of the exported
  model on onnxruntime (the best of steps 1e-2 to 3e-4; float32, a sanity check that needs
  no torch).

With ``--ort-optimized`` the exported model is first saved by onnxruntime after its graph
optimizations (ORT_ENABLE_EXTENDED), as a user who keeps ``optimized_model_filepath`` has it:
com.microsoft ops (FusedMatMul, SkipLayerNormalization, Gelu, BiasGelu, QuickGelu, FusedConv ...)
and onnxruntime's SimplifiedLayerNormalization replace the subgraphs they fuse, BatchNorm is
folded into Conv; the last columns list those ops. forward is then onnxruntime's run of that
saved model against torch.

Note (a trap met while writing this): torch.onnx.export(dynamo=False) puts the module back in
its mode with ``module.train(mode)``, which recurses: a wrapper left in training mode around a
model in eval mode leaves the model in training mode afterwards (dropout on, BatchNorm on batch
statistics), and a reference computed then is another function. The wrapper here is in eval mode.
"""
from __future__ import annotations

import argparse
import io
import logging
import sys
import time
import warnings

import numpy as np
import onnx
from onnx import numpy_helper

B, S, H = 2, 8, 32  # batch, sequence, width
TOL = 1e-4  # as tests/test_real_models.py: float32 on both sides


def _text(T):
    def cfg(cls, **kw):
        return cls(**{**dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, vocab_size=100, max_position_embeddings=64),
                      **kw})
    return {
        "bert": lambda: T.BertModel(cfg(T.BertConfig)),
        "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(
            dim=H, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=100,
            max_position_embeddings=64)),
        "roberta": lambda: T.RobertaModel(cfg(T.RobertaConfig)),
        "albert": lambda: T.AlbertModel(cfg(T.AlbertConfig, embedding_size=16)),
        "electra": lambda: T.ElectraModel(cfg(T.ElectraConfig, embedding_size=16)),
        "deberta_v2": lambda: T.DebertaV2Model(cfg(T.DebertaV2Config)),
        "mpnet": lambda: T.MPNetModel(cfg(T.MPNetConfig)),
        "t5_encoder": lambda: T.T5EncoderModel(T.T5Config(
            d_model=H, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=100)),
        "gpt2": lambda: T.GPT2Model(T.GPT2Config(n_embd=H, n_layer=2, n_head=2, vocab_size=100,
                                                 n_positions=64)),
        "gpt_neox": lambda: T.GPTNeoXModel(cfg(T.GPTNeoXConfig)),
        "llama": lambda: T.LlamaModel(cfg(T.LlamaConfig, num_key_value_heads=1)),
        "mistral": lambda: T.MistralModel(cfg(T.MistralConfig, num_key_value_heads=1)),
        "qwen2": lambda: T.Qwen2Model(cfg(T.Qwen2Config, num_key_value_heads=1)),
        "gemma": lambda: T.GemmaModel(cfg(T.GemmaConfig, num_key_value_heads=1, head_dim=16)),
        "phi": lambda: T.PhiModel(cfg(T.PhiConfig)),
    }


def _vision(T):
    vit = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               image_size=32, patch_size=8)
    return {
        "vit": lambda: T.ViTModel(T.ViTConfig(**vit)),
        "deit": lambda: T.DeiTModel(T.DeiTConfig(**vit)),
        "beit": lambda: T.BeitModel(T.BeitConfig(**vit, use_relative_position_bias=True)),
        "swin": lambda: T.SwinModel(T.SwinConfig(image_size=32, patch_size=4, embed_dim=16,
                                                 depths=[1, 1], num_heads=[1, 2], window_size=4)),
        "convnext": lambda: T.ConvNextModel(T.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1],
                                                             num_stages=2)),
        "resnet": lambda: T.ResNetModel(T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32],
                                                       depths=[1, 1])),
        "segformer": lambda: T.SegformerForSemanticSegmentation(T.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
            num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=3, patch_sizes=[7, 3],
            strides=[4, 2])),
    }


def nudged(make):
    """The architecture from its small config, in eval mode with eager attention, every
    parameter nudged by 0.02 N(0, 1) (see the module docstring)."""
    import torch
    torch.manual_seed(0)
    m = make().eval()
    m.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.02 * torch.randn(p.shape))
    return m


def params_by_bytes(params: dict) -> dict:
    """{(shape, bytes): (parameter name, transposed)}: the parameter an initializer holds, as
    it is or transposed (the dynamo exporter stores Linear weights transposed)."""
    out = {}
    for name, p in params.items():
        a = p.detach().numpy()
        out.setdefault((a.shape, a.tobytes()), (name, False))
        if a.ndim == 2:
            out.setdefault((a.T.shape, np.ascontiguousarray(a.T).tobytes()), (name, True))
    return out


def ort_optimized(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as onnxruntime saves it after its graph optimizations at ORT_ENABLE_EXTENDED:
    com.microsoft ops (FusedMatMul, SkipLayerNormalization, Gelu, FusedConv ...) in place of the
    subgraphs they fuse, BatchNorm folded into Conv."""
    import os
    import tempfile

    from onnxgrad.runtime import ort_module
    ort = ort_module()
    with tempfile.TemporaryDirectory() as d:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = os.path.join(d, "optimized.onnx")
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return onnx.load(so.optimized_model_filepath)


def check(name, make, vision: bool, dynamo: bool, optimized: bool = False) -> dict:
    """Export one model, differentiate it, compare with torch (see the module docstring)."""
    import torch
    import onnxgrad
    from fuzz_cases import quiet_session as session  # stock onnxruntime, as users run it

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, c, am=None):
            o = self.m(pixel_values=x) if vision else self.m(inputs_embeds=x, attention_mask=am)
            out = getattr(o, "logits", None)
            return ((o.last_hidden_state if out is None else out) * c).sum()

    m = nudged(make)
    w = Wrap(m).eval()

    def inputs(b, s):
        x = torch.randn(b, 3, 32, 32) if vision else \
            torch.randn(b, s, getattr(m.config, "embedding_size", None) or H)
        am = torch.ones(b, s, dtype=torch.int64)
        am[-1, s - 3:] = 0  # padding in the last sequence
        with torch.no_grad():
            o = m(pixel_values=x) if vision else m(inputs_embeds=x, attention_mask=am)
            out = getattr(o, "logits", None)
            c = torch.randn((o.last_hidden_state if out is None else out).shape)
        return (x, c) if vision else (x, c, am)

    names = ["x", "c"] if vision else ["x", "c", "am"]
    args = inputs(B, S)
    if dynamo:
        model = torch.onnx.export(w, args, input_names=names, output_names=["loss"],
                                  dynamo=True, verbose=False).model_proto
    else:  # symbolic batch (and sequence) dims: checked at other sizes than exported
        axes = {"x": {0: "batch"}, "c": {0: "batch"}} if vision else \
            {k: {0: "batch", 1: "seq"} for k in names}
        f = io.BytesIO()
        torch.onnx.export(w, args, f, input_names=names, output_names=["loss"], dynamo=False,
                          do_constant_folding=False, opset_version=17, dynamic_axes=axes)
        model = onnx.load_from_string(f.getvalue())
        args = inputs(B + 1, S - 2)
    x = args[0]
    if optimized:
        model = ort_optimized(model)

    inits = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    t0 = time.perf_counter()
    res = onnxgrad.gradients(model, "loss", ["x"] + [t.name for t in inits])
    build = time.perf_counter() - t0
    onnx.checker.check_model(res.model, full_check=True)
    feed = {k: v.numpy() for k, v in zip(names, args)}
    wanted = ["loss"] + [g for g in res.grads if g is not None]
    ours = dict(zip(wanted, session(res.model).run(wanted, feed)))

    xx = x.clone().requires_grad_(True)
    w.zero_grad()
    loss = w(xx, *args[1:])
    loss.backward()
    ref = float(loss)
    fwd = session(model)
    d = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    gd = float((ours[res.grads[0]].astype(np.float64) * d).sum())
    fds = [(float(fwd.run(["loss"], {**feed, "x": x.numpy() + h * d})[0])
            - float(fwd.run(["loss"], {**feed, "x": x.numpy() - h * d})[0])) / (2 * h)
           for h in (1e-2, 3e-3, 1e-3, 3e-4)]

    def rel(a, b, floor=0.0):
        return float(np.abs(a - b).max() / max(np.abs(b).max(), floor, 1e-30))

    params = dict(w.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in params.values() if p.grad is not None)
    # an initializer under another name (the dynamo exporter stores Linear weights transposed,
    # as new initializers): the parameter whose values, or transposed values, are its bytes
    by_bytes = params_by_bytes(params)
    # per parameter: ours summed over the initializers that hold it (a shared layer, ALBERT's,
    # is stored once per use when the exporter transposes it), then compared once with torch
    sums, folded = {}, 0  # parameter -> (its first initializer's name, ours or None)
    for t, g in zip(inits, res.grads[1:]):
        a = numpy_helper.to_array(t)
        pname, transposed, p = t.name, False, params.get(t.name)
        if p is not None and tuple(p.shape) == a.shape and \
                not np.array_equal(a, p.detach().numpy()):
            folded += 1  # another function of the parameter
            continue
        if p is None or tuple(p.shape) != a.shape:
            pname, transposed = by_bytes.get((a.shape, a.tobytes()), (None, False))
            if pname is None:
                continue
        first, acc = sums.get(pname, (t.name, None))
        if g is not None:
            mine = ours[g].T if transposed else ours[g]
            acc = mine if acc is None else acc + mine
        sums[pname] = (first, acc)
    worst, missing = (0.0, "-"), []
    for pname, (name, mine) in sums.items():
        p = params[pname]
        tg = np.zeros(p.shape, np.float32) if p.grad is None else p.grad.numpy()
        if mine is None:
            if np.abs(tg).max() > 0:
                missing.append(name)
            continue
        e = rel(mine, tg, 1e-3 * scale)
        if e > worst[0]:
            worst = (e, name)
    compared = len(sums)
    return dict(forward=rel(np.float32(ours["loss"]), np.float32(ref)),
                dx=rel(ours[res.grads[0]], xx.grad.numpy()), params=worst[0], worst=worst[1],
                compared=compared, folded=folded, missing=missing,
                fd=min(abs(f - gd) for f in fds) / max(abs(gd), 1e-12),
                nodes=len(model.graph.node), grad_nodes=len(res.model.graph.node), build=build,
                ort_ops=sorted({n.op_type for n in model.graph.node if n.domain == "com.microsoft"
                                or n.op_type == "SimplifiedLayerNormalization"}))


def main(argv=None) -> int:
    import transformers as T
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    text, vision = _text(T), _vision(T)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help=f"any of {', '.join([*text, *vision])}")
    p.add_argument("--exporter", choices=["ts", "dynamo", "both"], default="both")
    p.add_argument("--ort-optimized", action="store_true",
                   help="differentiate the model as onnxruntime saves it after its graph "
                        "optimizations (ORT_ENABLE_EXTENDED: com.microsoft fused ops)")
    args = p.parse_args(argv)
    unknown = [m for m in args.models if m not in text and m not in vision]
    if unknown:
        p.error(f"unknown model(s) {unknown}")
    exporters = {"ts": [False], "dynamo": [True], "both": [False, True]}[args.exporter]
    print("| model | exporter | nodes | gradient nodes | build s | forward | dx | params "
          "(compared / folded) | worst tensor | fd (dx) | onnxruntime's ops | verdict |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|")
    bad = 0
    for dynamo in exporters:
        for name, make in [*text.items(), *vision.items()]:
            if args.models and name not in args.models:
                continue
            exp = ("dynamo" if dynamo else "TorchScript") + (
                " + onnxruntime optimizer" if args.ort_optimized else "")
            try:
                r = check(name, make, name in vision, dynamo, args.ort_optimized)
            except Exception as err:  # a refusal or a crash is a finding: report it, go on
                bad += 1
                print(f"| {name} | {exp} | | | | | | | | | | {type(err).__name__}: "
                      f"{str(err)[:200]} |", flush=True)
                continue
            ok = max(r["forward"], r["dx"], r["params"]) < TOL and not r["missing"]
            bad += not ok
            print(f"| {name} | {exp} | {r['nodes']} | {r['grad_nodes']} | {r['build']:.2f} "
                  f"| {r['forward']:.0e} | {r['dx']:.0e} | {r['params']:.0e} "
                  f"({r['compared']} / {r['folded']}) | {r['worst']} | {r['fd']:.0e} "
                  f"| {', '.join(r['ort_ops'])} | {'ok' if ok else 'MISMATCH ' + ', '.join(r['missing'][:3])} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
