"""Write a tiny random-weight LLaVA checkpoint that real vLLM serves on CPU, for EPD tests.

Run with the vLLM venv's python (it has torch and transformers):
    python tiny_vlm.py TOKENIZER_DIR OUT_DIR
TOKENIZER_DIR is the reference engine's `--export-model` of `tiny64` (a 258-token byte-level
tokenizer); one token, `<image>` (258), is added. The vision tower is CLIP (32x32 images, 8x8
patches: 16 image tokens after the class token is dropped), the language model Llama; the
weights are seeded, so two writes give the same model.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

IMAGE_TOKEN = "<image>"
# Text parts as they are, every image part as `<image>` (the processor expands it to 16).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}{% endfor %}"
    "{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def write(tokenizer_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                         vision_feature_layer=-1, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu", image_seq_length=16)
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    _legacy_vision_names(out / "model.safetensors")
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                               vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                               num_additional_image_tokens=1)
    processor.save_pretrained(str(out))
    gen = out / "generation_config.json"
    gen.write_text(json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}))


def _legacy_vision_names(path: Path) -> None:
    """transformers 5 saves the CLIP tower as `vision_tower.*`; vLLM's loader wants the
    checkpoint names of released LLaVA models, `vision_tower.vision_model.*`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {("vision_tower.vision_model." + k.removeprefix("vision_tower.") if k.startswith("vision_tower.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})


if __name__ == "__main__":
    write(Path(sys.argv[1]), Path(sys.argv[2]))
