import json, sys
from tokenizers import Tokenizer
tok = Tokenizer.from_file("/root/.cache/mlx_spec/models/smollm2-135m-instruct-f32/tokenizer.json")
f, pid = sys.argv[1], sys.argv[2]
r = json.load(open(f))["replies"][pid]
if len(sys.argv) > 3:
    print(repr(tok.decode(r["prompt"])))
print("-----")
print(tok.decode(r["reply"]))
