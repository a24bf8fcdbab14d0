"""The PyTorch models that bench/train_step.py exports with torch.onnx and trains on both sides.

torchvision cannot be imported beside torch 2.13 on the project's machine, so ResNet-18 and
MobileNetV3-small are written out here from torch.nn with torchvision's architectures (the
layers, shapes, strides, paddings, groups, activations and BatchNorm settings of
``torchvision.models.resnet18`` and ``mobilenet_v3_small``), with two differences that change no
layer shape: 10 classes, and MobileNetV3's classifier dropout set to 0 (as every model here has
no dropout) so that both sides compute the same function. Weights keep torch.nn's default
initialisation (torchvision re-initialises them; the speed does not depend on it).

    make(name) -> (nn.Module, example input shape without the batch axis, default batch size)
    labels(name, batch, shape, rng) -> a batch's int64 class labels
"""
from __future__ import annotations

import torch
from torch import nn

F = nn.functional


class MLP(nn.Module):
    """784-1024-1024-10, ReLU."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 1024), nn.Linear(1024, 1024), \
            nn.Linear(1024, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    """Conv 3x3 padding 1, ReLU, MaxPool 2, twice, then Linear, on 1x28x28 (the issue's CNN)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


# -- ResNet-18 (torchvision.models.resnet.resnet18) -------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# -- MobileNetV3-small (torchvision.models.mobilenetv3.mobilenet_v3_small) ---------------------
def _divisible(v, divisor=8):
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def _conv_bn_act(cin, cout, k, stride=1, groups=1, act=None):
    layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
              nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
    return nn.Sequential(*layers, act()) if act else nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, c, squeeze):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return F.hardsigmoid(self.fc2(F.relu(self.fc1(s)))) * x


class InvertedResidual(nn.Module):
    def __init__(self, cin, k, exp, cout, se, hs, stride):
        super().__init__()
        act = nn.Hardswish if hs else nn.ReLU
        layers = []
        if exp != cin:
            layers.append(_conv_bn_act(cin, exp, 1, act=act))
        layers.append(_conv_bn_act(exp, exp, k, stride, groups=exp, act=act))
        if se:
            layers.append(SqueezeExcitation(exp, _divisible(exp // 4)))
        layers.append(_conv_bn_act(exp, cout, 1))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return y + x if self.residual else y


_SMALL = [  # input, kernel, expanded, output, SE, hardswish, stride
    (16, 3, 16, 16, True, False, 2), (16, 3, 72, 24, False, False, 2),
    (24, 3, 88, 24, False, False, 1), (24, 5, 96, 40, True, True, 2),
    (40, 5, 240, 40, True, True, 1), (40, 5, 240, 40, True, True, 1),
    (40, 5, 120, 48, True, True, 1), (48, 5, 144, 48, True, True, 1),
    (48, 5, 288, 96, True, True, 2), (96, 5, 576, 96, True, True, 1),
    (96, 5, 576, 96, True, True, 1)]


class MobileNetV3Small(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        layers = [_conv_bn_act(3, 16, 3, 2, act=nn.Hardswish)]
        layers += [InvertedResidual(*cfg) for cfg in _SMALL]
        layers.append(_conv_bn_act(96, 576, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(),
                                        nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class Transformer(nn.Module):
    """nn.TransformerEncoder, 2 layers, d 256, 4 heads, feed-forward 1024, no dropout, on
    [N, 64, 256] features; mean over the sequence, then Linear(256 -> 10)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.fc = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc(self.encoder(x).mean(1))


class UNet(nn.Module):
    """A two-level U-Net for segmentation (Ronneberger et al.'s shape, smaller): per level two
    3x3 Conv-BatchNorm-ReLU, MaxPool 2 down, ConvTranspose 2x2 stride 2 up with the skip
    concatenated, and a 1x1 Conv to per-pixel logits of SEGMENT_CLASSES classes."""

    def __init__(self, c=16):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU())
        self.enc1, self.enc2, self.mid = block(3, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, 2), block(4 * c, 2 * c)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * c, c, 2, 2), block(2 * c, c)
        self.head = nn.Conv2d(c, SEGMENT_CLASSES, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        return self.head(self.dec1(torch.cat([self.up1(d2), e1], 1)))


SEGMENT_CLASSES = 4


MODELS = {  # name: (class, input shape without the batch axis, batch size)
    "mlp": (MLP, (784,), 256),
    "cnn": (CNN, (1, 28, 28), 64),
    "resnet18": (ResNet18, (3, 64, 64), 32),
    "mobilenetv3": (MobileNetV3Small, (3, 64, 64), 64),
    "transformer": (Transformer, (64, 256), 32),
    "unet": (UNet, (3, 64, 64), 16),
}


def labels(name: str, batch: int, shape, rng):
    """Random class labels for a batch: one per pixel for the segmentation model, else one per
    row of 10 classes."""
    if name == "unet":
        return rng.integers(0, SEGMENT_CLASSES, (batch, *shape[1:]))
    return rng.integers(0, 10, batch)


def make(name: str, seed: int = 0):
    cls, shape, batch = MODELS[name]
    torch.manual_seed(seed)
    return cls().train(), shape, batch


def export(module: nn.Module, shape, batch: int, path: str, exporter: str) -> None:
    """Write ``module`` (in training mode: BatchNorm on batch statistics) as ONNX with a symbolic
    batch axis; exporter "torchscript" (dynamo=False) or "dynamo"."""
    x = torch.zeros(batch, *shape)
    if exporter == "torchscript":
        torch.onnx.export(module, (x,), path, input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}}, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
    else:
        prog = torch.onnx.export(module, (x,), input_names=["x"], output_names=["logits"],
                                 dynamic_shapes=({0: torch.export.Dim("N")},), dynamo=True,
                                 optimize=False, verbose=False)
        if not any(n.op_type == "BatchNormalization" for n in prog.model.graph.all_nodes()):
            plain = _ir_copy(prog.model)
            prog.optimize()
            prog.save(path)
            if not _params_kept(path, module):
                # the optimizer folded Transposes of weights into new constants, or merged
                # parameters whose values are equal (TransformerEncoder's LayerNorms): keep the
                # unoptimised graph, whose initializers are the module's parameters
                import onnx_ir as ir
                ir.save(plain, path)
            return
        # the exporter writes BatchNorm of a training-mode module as an inference
        # BatchNormalization (running statistics), and its optimizer folds that into the Conv
        # whatever training_mode says: fold only constants, then mark the nodes training_mode=1
        # (batch statistics, as the module computes; onnx wants the two statistics outputs too)
        import onnx
        import onnxscript.optimizer as opt
        opt.fold_constants(prog.model)
        opt.remove_unused_nodes(prog.model)
        prog.save(path)
        m = onnx.load(path)
        for n in m.graph.node:
            if n.op_type == "BatchNormalization" and module.training:
                n.attribute.append(onnx.helper.make_attribute("training_mode", 1))
                n.output.extend([f"{n.output[0]}.running_mean", f"{n.output[0]}.running_var"])
        onnx.save(m, path)


def _ir_copy(model):
    import onnx_ir as ir
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def _params_kept(path: str, module: nn.Module) -> bool:
    import onnx
    inits = {t.name for t in onnx.load(path, load_external_data=False).graph.initializer}
    return all(name in inits for name, _ in module.named_parameters())
