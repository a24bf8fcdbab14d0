"""Hugging Face text models after onnxruntime's transformers optimizer, against torch autograd.

    pip install transformers          # not in the test extras
    python bench/hf_transformers_optimizer.py                 # bert distilbert roberta ...
    python bench/hf_transformers_optimizer.py bert albert

``onnxruntime.transformers.optimizer.optimize_model`` (what optimum and Olive run for BERT-like
models) rewrites a model around com.microsoft ops: EmbedLayerNormalization (the embeddings and
their LayerNorm, from input_ids), Attention (one GEMM of merged q/k/v weights, the heads, the
padding mask as key lengths), SkipLayerNormalization, BiasGelu, FastGelu; with its
``use_multi_head_attention`` option (rows "+mha") MultiHeadAttention; BART and T5 (rows
"bart", "t5") as encoder-decoders, the decoder's length (5) other than the encoder's (8).
Each architecture of bench/hf_models.py's text list that the optimizer knows as "bert" (or
"gpt2") is built from the same small random config, exported by the TorchScript exporter with
input_ids, an attention mask that pads the second sequence, and symbolic batch and sequence
dims, optimized, and differentiated with respect to every float initializer;
f = sum(last_hidden_state * c).

Each torch parameter's gradient is compared with the sum of ours over the initializers that
hold it: under its bytes, transposed, or as a third of a merged q/k/v weight or bias (a layer
shared by ALBERT is fused once and kept once). torch gives the padding_idx row of an embedding
no gradient by design (its forward is the same), so that row is left out of the comparison.
Prints max |ours - torch| / max |torch| (floor 1e-3 of the largest gradient) per model.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import tempfile
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_encoder_decoder import models as enc_dec_models, row  # noqa: E402
from hf_models import _text, nudged, params_by_bytes  # noqa: E402

# row -> model_type for the optimizer; "+mha": with its use_multi_head_attention option
# (MultiHeadAttention from separate q, k, v projections, as it writes for T5, BART, Whisper)
MODELS = {"bert": "bert", "distilbert": "bert", "roberta": "bert", "electra": "bert",
          "albert": "bert", "deberta_v2": "bert", "mpnet": "bert", "gpt2": "gpt2",
          "t5_encoder": "t5", "llama": "gpt2", "bert+mha": "bert", "roberta+mha": "bert",
          "electra+mha": "bert", "bart": "bart", "t5": "t5"}
# encoder-decoder rows (decoder_input_ids of another length than input_ids), built as
# bench/hf_encoder_decoder.py builds them
ENC_DEC = ("bart", "t5")


def check(name: str, make, model_type: str) -> dict:
    import onnx
    import torch
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    import onnxgrad
    from onnxgrad.runtime import session

    m = nudged(make)
    enc_dec = name in ENC_DEC

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, am, c, dids=None):
            out = self.m(input_ids=ids, attention_mask=am, **(
                {"decoder_input_ids": dids} if enc_dec else {}))
            return (out.last_hidden_state * c).sum()

    w = Wrap(m).eval()
    ids = torch.randint(2, 100, (2, 8))
    ids[0, 0] = 0  # padding_idx rows of some embeddings: see the module docstring
    am = torch.ones(2, 8, dtype=torch.int64)
    am[1, 5:] = 0
    dids = torch.randint(2, 100, (2, 5))  # the decoder's length differs from the encoder's
    c = torch.randn(2, 5 if enc_dec else 8, m.config.hidden_size)
    args, names = ((ids, am, c, dids), ["ids", "am", "c", "dids"]) if enc_dec else \
        ((ids, am, c), ["ids", "am", "c"])
    axes = {k: {0: "b", 1: "t" if enc_dec and k in ("c", "dids") else "s"} for k in names}
    f = io.BytesIO()
    torch.onnx.export(w, args, f, dynamo=False, opset_version=17, input_names=names,
                      output_names=["loss"], dynamic_axes=axes, do_constant_folding=False)
    with tempfile.NamedTemporaryFile(suffix=".onnx") as tmp:
        tmp.write(f.getvalue())
        tmp.flush()
        options = FusionOptions(model_type)
        options.use_multi_head_attention = name.endswith("+mha")
        model = optimizer.optimize_model(tmp.name, model_type=model_type,
                                         num_heads=m.config.num_attention_heads,
                                         hidden_size=m.config.hidden_size,
                                         optimization_options=options).model
    inits = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    res = onnxgrad.gradients(model, "loss", [t.name for t in inits])
    onnx.checker.check_model(res.model, full_check=True)
    feed = dict(zip(names, (a.numpy() for a in args)))
    names = [g for g in res.grads if g is not None]
    ours = dict(zip(names, session(res.model).run(names, feed)))
    loss = w(*args)
    loss.backward()
    forward = float(session(model).run(["loss"], feed)[0])

    params = dict(w.named_parameters())
    by_bytes = params_by_bytes(params)
    sums: dict = {}
    for t, g in zip(inits, res.grads):
        if g is None:
            continue
        a = onnx.numpy_helper.to_array(t)
        pieces, grads = [a], [ours[g]]
        if (a.shape, a.tobytes()) not in by_bytes and a.ndim and a.shape[-1] % 3 == 0:  # q|k|v
            pieces, grads = np.split(a, 3, axis=-1), np.split(ours[g], 3, axis=-1)
        hits = [by_bytes.get((p.shape, np.ascontiguousarray(p).tobytes())) for p in pieces]
        if not all(hits):
            continue  # another function of the parameters
        for (pname, transposed), mine in zip(hits, grads):
            sums[pname] = sums.get(pname, 0) + (mine.T if transposed else mine)
    modules = dict(w.named_modules())
    scale = max(float(p.grad.abs().max()) for p in params.values() if p.grad is not None)
    worst = (0.0, "-")
    for pname, mine in sums.items():
        want = params[pname].grad
        if want is None:
            continue
        mine = np.array(mine)
        owner = modules.get(pname.rsplit(".", 1)[0])
        if isinstance(owner, torch.nn.Embedding) and owner.padding_idx is not None:
            mine[owner.padding_idx] = 0
        err = float(np.abs(mine - want.numpy()).max() / max(float(want.abs().max()),
                                                             1e-3 * scale))
        worst = max(worst, (err, pname))
    return dict(ops=sorted({n.op_type for n in model.graph.node if n.domain == "com.microsoft"
                            or n.op_type == "SimplifiedLayerNormalization"}),
                forward=abs(forward - float(loss)) / abs(float(loss)), worst=worst,
                compared=len(sums), params=len(params))


def main(argv=None) -> int:
    import transformers as T
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    names = (argv if argv is not None else sys.argv[1:]) or list(MODELS)
    text, enc_dec = _text(T), enc_dec_models(T)
    print("| model | onnxruntime's ops | forward | worst parameter | compared / parameters "
          "| verdict |")
    print("|---|---|---:|---:|---:|---|")
    bad = 0
    for name in names:
        try:
            make = enc_dec[name] if name in ENC_DEC else text[name.split("+")[0]]
            r = check(name, make, MODELS[name])
        except Exception as err:  # a refusal or a crash is a finding: report it, go on
            bad += 1
            print(f"| {name} | | | | | {type(err).__name__}: {str(err)[:200]} |", flush=True)
            continue
        line, ok = row([name], r)
        bad += not ok
        print(line, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
