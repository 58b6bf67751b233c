"""The embedded SmolLM2 GGUF rewritten with 16-bit tensors, for llama.cpp.

radixserve serves the embedded model (``radixserve/models/embedded.py``: a Q4_1 /
Q8_0 GGUF) by dequantizing every tensor and computing in bfloat16. To compare
llama.cpp on the same weights, this writes the same file with each quantized
tensor dequantized to bfloat16 (or float16): every metadata field (architecture,
tokenizer, chat template) is copied unchanged, only the tensor types and the file
type change.

    python bench/gguf_bf16.py OUT.gguf [--type bf16|f16]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    import gguf

    from radixserve.models.embedded import smollm2_gguf_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--type", choices=["bf16", "f16"], default="bf16")
    args = ap.parse_args()
    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(args.out, arch)
    qtype = gguf.GGMLQuantizationType.BF16 if args.type == "bf16" else gguf.GGMLQuantizationType.F16
    file_type = (
        gguf.LlamaFileType.MOSTLY_BF16 if args.type == "bf16" else gguf.LlamaFileType.MOSTLY_F16
    )
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        if name == "general.file_type":
            writer.add_file_type(file_type)
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        values = values.reshape(shape)
        if values.ndim == 1:  # norms stay float32, as llama.cpp's converter keeps them
            writer.add_tensor(t.name, values)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.0f} MiB, {args.type})")


if __name__ == "__main__":
    main()
