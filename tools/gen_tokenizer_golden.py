#!/usr/bin/env python3
"""Golden data for the byte-level BPE tokenizer (services/tokenizer/).

From the default model's GGUF (read with the `gguf` package) this builds,
with the Hugging Face `tokenizers` library, three tokenizer.json files over
the same SmolLM2 vocabulary and merges, differing only in pre-tokenizer:

  smollm  Sequence[Digits(individual_digits), ByteLevel]   (SmolLM2's own)
  gpt2    ByteLevel(use_regex)                              (merges written
          as "a b" strings, so the loader's legacy form is covered too)
  llama3  Sequence[Split(llama3 regex), ByteLevel(use_regex=false)], with
          ignore_merges like Llama 3's own tokenizer.json

then a corpus of strings with, for each, the reference ids of all three
(encode with add_special_tokens=False; special tokens parsed).

    python3 tools/gen_tokenizer_golden.py [--model M] [--check]

Everything is deterministic: rerunning rewrites the committed files byte for
byte (--check compares instead of writing).
"""
import argparse
import json
import os
import random
import sys

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

OUT_DIR = "tests/golden/tokenizer"
CONFIGS = ("smollm", "gpt2", "llama3")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS_SEED = 20240611


# --------------------------------------------------------------------------
# GGUF -> tokenizers

def field_str(reader, key):
    f = reader.fields[key]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def field_int(reader, key):
    f = reader.fields[key]
    return int(f.parts[f.data[0]][0])


def field_strs(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def field_ints(reader, key):
    f = reader.fields[key]
    return [int(f.parts[i][0]) for i in f.data]


def read_gguf(path):
    r = gguf.GGUFReader(path)
    tokens = field_strs(r, "tokenizer.ggml.tokens")
    types = field_ints(r, "tokenizer.ggml.token_type")
    merges = field_strs(r, "tokenizer.ggml.merges")
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "bos": field_int(r, "tokenizer.ggml.bos_token_id"),
        "eos": field_int(r, "tokenizer.ggml.eos_token_id"),
        "template": field_str(r, "tokenizer.chat_template"),
        "pre": field_str(r, "tokenizer.ggml.pre"),
    }


def build_tokenizer(g, config):
    vocab = {t: i for i, t in enumerate(g["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in g["merges"]]
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=(config == "llama3"))
    tk = Tokenizer(bpe)
    if config == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif config == "gpt2":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(g["tokens"], g["types"]) if ty == 3]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=False,
                                      rstrip=False, single_word=False) for t in specials])
    return tk


def tokenizer_json_text(tk, config):
    doc = json.loads(tk.to_str())
    if config == "gpt2":
        doc["model"]["merges"] = [" ".join(m) for m in doc["model"]["merges"]]
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n"


def tokenizer_config_text(g):
    doc = {
        "add_bos_token": False,
        "bos_token": g["tokens"][g["bos"]],
        "eos_token": g["tokens"][g["eos"]],
        "chat_template": g["template"],
    }
    return json.dumps(doc, ensure_ascii=False, indent=2) + "\n"


# --------------------------------------------------------------------------
# Corpus

PROSE = [
    "Hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "SmolLM2 is a family of compact language models available in three sizes.",
    "Mr. Smith's dog didn't bark; the neighbours' cats weren't impressed.",
    "She said: \"I'll be there at 5 o'clock, won't you?\"",
    "A sentence with an em dash \u2014 and an en dash \u2013 and an ellipsis\u2026",
    "\u201cSmart quotes\u201d and \u2018single ones\u2019 are common in copied text.",
    "In 1969, Apollo 11 landed on the Moon; 384,400 km away.",
    "Prices rose 3.5% to $1,234.56 (about \u20ac1.150,00) last quarter.",
    "Call +1 (555) 123-4567 or email info@example.com before 2024-06-11T09:30:00Z.",
    "The URL is https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2#top",
    "e.g., i.e., etc., vs. \u2014 abbreviations everywhere.",
    "ALL CAPS TEXT IS SHOUTING, isn't it?",
    "camelCaseIdentifiers and snake_case_identifiers and kebab-case-identifiers",
    "Supercalifragilisticexpialidocious and pneumonoultramicroscopicsilicovolcanoconiosis",
    "O'Reilly O'NEIL o'brien rock'n'roll y'all'd've",
    "Tab\tseparated\tvalues\there",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "Na\u00efve caf\u00e9 r\u00e9sum\u00e9 fa\u00e7ade co\u00f6perate se\u00f1or \u00fcber Stra\u00dfe",
    "\u00bfQu\u00e9 tal? \u00a1Muy bien! \u00c7a va tr\u00e8s bien, merci.",
    "Der Schl\u00fcssel liegt unter der Fu\u00dfmatte, sagte die Gro\u00dfmutter.",
    "\u0416\u0438\u043b-\u0431\u044b\u043b \u043f\u0451\u0441, \u043a\u043e\u0442\u043e\u0440\u044b\u0439 \u043b\u044e\u0431\u0438\u043b \u0433\u0443\u043b\u044f\u0442\u044c.",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5! \u0391\u03b2\u03b3\u03b4\u03b5.",
    "Ti\u1ebfng Vi\u1ec7t c\u00f3 nhi\u1ec1u d\u1ea5u thanh.",
    "T\u00fcrk\u00e7e: \u0130stanbul, \u0131\u015f\u0131k, \u011f\u00fczel.",
    "Polski: Za\u017c\u00f3\u0142\u0107 g\u0119\u015bl\u0105 ja\u017a\u0144.",
]

CODE = [
    "def add(a, b):\n    return a + b\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n",
    "class Foo(object):\n    \"\"\"Docstring.\"\"\"\n\n    def __init__(self, x: int = 0) -> None:\n        self._x = x  # comment\n",
    "#include <stdio.h>\n\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "for (size_t i = 0; i < n; ++i) { a[i] = b[i] * c[i] + d; }",
    "static inline uint32_t rotl(uint32_t x, int k) { return (x << k) | (x >> (32 - k)); }",
    "fn main() {\n    let v: Vec<u8> = vec![1, 2, 3];\n    println!(\"{:?}\", v.iter().map(|x| x * 2).collect::<Vec<_>>());\n}\n",
    "impl<'a, T: Clone + 'a> Iterator for Foo<'a, T> { type Item = &'a T; }",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello\")\n}\n",
    "const f = async (x) => { await fetch(`/api/${x}`); return x ?? null; };",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "<html><head><title>Test</title></head><body><p class=\"x\">Hi &amp; bye</p></body></html>",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\"; done\n",
    "x = [i**2 for i in range(100) if i % 3 == 0]\n",
    "    indented with four spaces\n        and eight\n\t\tand two tabs\n",
    "if (a != b && c <= d || !e) { x += 1; y -= 2; z *= 3; w /= 4; }",
    "// C++ comment\nstd::vector<std::string> v{\"a\", \"b\"};\nauto it = v.begin();\n",
    "public static void main(String[] args) { System.out.println(\"Hi\"); }",
    "local t = { x = 1, y = 2 } -- Lua\nfor k, v in pairs(t) do print(k, v) end",
    "matrix:\n  - name: test\n    value: 0x1F\n    enabled: yes\n",
    "$ ls -la /usr/local/bin | grep -E '^-rwx' > out.log 2>&1",
    "@media (max-width: 600px) { .nav > li:hover { color: #ff00ff; } }",
    "\\begin{equation} E = mc^2 \\end{equation} % LaTeX",
    "a=1;b=2;c=a+b;print(c)",
    "return x->next->prev == x ? NULL : &x->data[0];",
]

NUMBERS = [
    "0", "7", "42", "123", "1234", "12345", "123456789", "1234567890123456789012345",
    "3.14159265358979", "1,000,000", "1.000.000,50", "1 000 000", "-17", "+42", "1e-9", "6.022e23",
    "0x7fffffff", "0b101010", "0o777", "v1.2.3", "2024-06-11", "12:34:56", "99.9%", "#1", "No.7",
    "1/2 + 3/4 = 5/4", "\u00bd \u00bc \u00be", "\u00b2\u00b3\u00b9", "\u2160 \u2161 \u2162 \u216b",
    "\u0661\u0662\u0663\u0664\u0665", "\u0967\u0968\u0969", "\u4e00\u4e8c\u4e09 123 \u2460\u2461\u2462",
    "a1b2c3d4", "abc123def456", "route66", "H2O CO2 C6H12O6", "ipv4 192.168.0.1 ipv6 ::1",
    "  12  ", "1\n2\n3", "x=1000000;y=2000000", "\uff11\uff12\uff13",
]

WHITESPACE = [
    "", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", "\n\n\n\n\n\n\n\n",
    " \n", "\n ", " \n ", "  \n  ", "\t\n\t", "\r", "\r\r\n\n", "a\r\nb\r\nc",
    "trailing space ", "trailing spaces   ", "trailing tab\t", "trailing newline\n",
    " leading space", "   leading spaces", "\tleading tab", "\nleading newline",
    "word  word", "word   word", "word\t\tword", "word \t word", "word\n\nword",
    "a \n\n b", "x  \n\n  y", "line1\nline2\n\nline4\n\n\n", "  \u00a0  ", "a\u00a0b",
    "a\u3000b", "\u2003em\u2002en\u2009thin", "a\u2028b\u2029c", "a\u0085b", "\u200bzero\u200bwidth",
    "end with spaces and newline  \n", " \t \t ", "\n \n \n", "a\x0bb\x0cc",
    "mixed \t\n\r\n \u00a0\u3000 whitespace", "  hello", "   123", "  !!", "  \n  hello",
]

MULTILINGUAL = [
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01",
    "\u6211\u7231\u81ea\u7136\u8bed\u8a00\u5904\u7406\u3002\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002\u30ab\u30bf\u30ab\u30ca\u3082\u3002",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4.",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0627\u0644\u0644\u063a\u0629 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u062c\u0645\u064a\u0644\u0629 \u0661\u0662\u0663",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u092d\u093e\u0937\u093e \u092e\u0947\u0902 \u0932\u093f\u0916\u093e \u0917\u092f\u093e \u0935\u093e\u0915\u094d\u092f\u0964",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a",
    "\u1019\u103c\u1014\u103a\u1019\u102c\u1018\u102c\u101e\u102c",
    "\u10e5\u10d0\u10e0\u10d7\u10e3\u10da\u10d8",
    "\u0540\u0561\u0575\u0565\u0580\u0565\u0576",
    "\u12a0\u121b\u122d\u129b",
    "\u0ba4\u0bae\u0bbf\u0bb4\u0bcd \u0bae\u0bca\u0bb4\u0bbf",
    "\u0f56\u0f7c\u0f51\u0f0b\u0f66\u0f90\u0f51\u0f0d",
    "Mixed English \u4e2d\u6587 and \u0627\u0644\u0639\u0631\u0628\u064a\u0629 and \u0939\u093f\u0928\u094d\u0926\u0940.",
    "\u4e2d\u6587\u6807\u70b9\uff1a\u300c\u5f15\u53f7\u300d\u3001\u987f\u53f7\u3001\uff08\u62ec\u53f7\uff09",
    "\uff21\uff22\uff23 \uff41\uff42\uff43 \uff01\uff1f",
    "\U00020000\U0002a6d6 \U00020bb7\u91ce\u5bb6",
]

EMOJI = [
    "\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466",
    "\U0001F3F3\uFE0F\u200D\U0001F308", "\U0001F1FA\U0001F1F8\U0001F1EF\U0001F1F5\U0001F1E9\U0001F1EA",
    "I \u2764\uFE0F NY", "\U0001F469\U0001F3FB\u200D\U0001F4BB working", "\u2603 \u2600 \u2601",
    "emoji\U0001F525fire\U0001F525", "\U0001F9D1\u200D\U0001F91D\u200D\U0001F9D1",
    "\U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F",
    "1\uFE0F\u20E3 #\uFE0F\u20E3", "\u263A\uFE0E text style", "\U0001F600\U0001F601\U0001F602\U0001F923",
]

COMBINING = [
    "cafe\u0301", "Cafe\u0301 nai\u0308ve re\u0301sume\u0301", "e\u0301\u0301\u0301",
    "\u0065\u0300\u0301\u0302\u0303\u0304", "n\u0303", "A\u030a", "\u0301alone",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367\u0369\u0358\u0320G\u0311\u0357\u030e\u0305\u035b\u0341\u0334\u033b\u0348\u034d\u0354\u0339O\u0342\u030c\u030c\u0358\u0328\u0335\u0339\u033b\u031d\u0333",
    "\u1100\u1161\u11a8", "\u0915\u094d\u0937", "' \u0301s", "x\u20dd",
]

CONTRACTIONS = [
    "don't can't won't isn't I'm you're we've they'll he'd she's it's",
    "DON'T CAN'T WON'T ISN'T I'M YOU'RE WE'VE THEY'LL HE'D SHE'S IT'S",
    "Don'T cAn't wOn'T I'M you'Re we'Ve they'lL he'D she'S",
    "'s 't 're 've 'm 'll 'd", "'S 'T 'RE 'VE 'M 'LL 'D", "'Re 'rE 'Ve 'vE 'Ll 'lL",
    "'sx 'tx 'rex 'vex 'mx 'llx 'dx", "'Sx 'Tx 'REx 'VEx 'Mx 'LLx 'Dx",
    "'x 'r 'v 'l ''s '''", "it\u2019s curly", "'\u017fx long s", "'\u212a kelvin",
    "rock'n'roll", "'hello' \"world\"", "y'all'd've", "'123 '4", "' s", "'", "''", "'s'", "'\n",
]

CONTROL = [
    "\x01\x02\x03", "bell\x07here", "esc\x1b[31mred\x1b[0m", "\x7f del", "\x1c\x1d\x1e\x1f sep",
    "a\x1cb\x1dc", "\x08backspace", "form\x0cfeed", "vertical\x0btab", "\u00ad soft hyphen",
    "\u200e\u200f lrm rlm", "\u202e reversed \u202c", "\ufeffBOM at start", "\u2060word\u2060joiner",
]

ODD = [
    "\ufffd", "replacement \ufffd char", "\ufffd\ufffd\ufffd", "\ufdd0\ufdef noncharacters \ufffe\uffff",
    "\U0001fffe\U0010ffff", "\ue000 private \U000f0000", "\u00c3\u00a9 \u00c3\u00a8 mojibake",
    "\u00e2\u0080\u0099 \u00e2\u0080\u009c smart mojibake", "\u00c3\u0083\u00c2\u00a9",
    "\\xff\\xfe invalid-looking", "\\x80\\x81", "%C3%A9 %E2%82%AC", "\\u00e9 \\U0001F600",
    "&#x1F600; &eacute; &amp;", "\\0 \\n \\t \\\\ escapes as text",
    "\u2126 \u212b \u2160", "\ufb01 \ufb02 \ufb00 \ufb05", "\u0130 \u0131 \u017f \u1e9e",
    "\U0001d400\U0001d401 math bold", "\u24b6\u24b7 circled", "\u00aa\u00ba ordinals",
]

SPECIALS = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>", "<|endoftext|><|endoftext|>", "text<|endoftext|>more text",
    "<|im_sta", "<|im_start", "<|im_start|", "<|im_end|", "<|im_start|><|im_end|>",
    "<<|im_start|>>", "<|<|im_end|>|>", " <|im_start|> ", "\n<|im_end|>\n",
    "<repo_name>aerie<file_sep>main.c<filename>x.py", "<reponame>foo<gh_stars>10",
    "<issue_start>bug<issue_comment>fix<issue_closed>", "<jupyter_start><jupyter_code>x=1<jupyter_output>1",
    "<jupyter_text>md<empty_output>", "<commit_before>a<commit_msg>b<commit_after>",
    "<|IM_START|> not special", "< |im_start| >", "<im_start>", "<|im_start|>user\n<|im_start|>user\n",
]

LONG = [
    "a" * 300, "ab" * 200, "x" * 64 + " " + "y" * 64, "0123456789" * 20, " " * 100, "\n" * 50,
    "-" * 120, "=" * 80 + "\n", "\u4e2d" * 150, "\U0001F600" * 40, "\u00e9" * 100,
    "Pneumonoultramicroscopicsilicovolcanoconiosis" * 5, "aAbBcCdDeE" * 30,
    "https://example.com/" + "very/long/path/" * 20, "\t" * 40 + "x",
]

WORDS = ("the of and to in is was for on that with as by at from this be are it "
         "model token merge byte level unicode server gateway draft target cache "
         "don't I'll we're they've she'd HELLO World Foo_bar x86_64 3D 42nd "
         "caf\u00e9 na\u00efve \u4e2d\u6587 \u0645\u0631\u062d\u0628\u0627 \u0928\u092e\u0938\u094d\u0924\u0947 \U0001F600 "
         "\u2014 \u2026 ( ) [ ] { } < > ; : , . ! ? ' \" ` ~ @ # $ % ^ & * - + = / \\ | _").split(" ")
SEPS = [" ", " ", " ", " ", "  ", "\n", "\t", "\r\n", "", "\n\n", " \n", "   ", "\u00a0"]
ATOMS = ["a", "Z", "\u00e9", "\u4e2d", "1", "\u0661", " ", "  ", "\t", "\n", "\r", "'", "'s", "'LL",
         ".", "!!", "<|im_end|>", "<|im_sta", "\U0001F600", "\u200d", "\u0301", "\u00a0",
         "\u3000", "_", "-", "0", "99", "x1", "\x1f", "\ufffd"]


def generated(rng):
    out = []
    # Word salads: prose-like mixtures with varied separators.
    for _ in range(90):
        n = rng.randint(1, 25)
        parts = []
        for _ in range(n):
            parts.append(rng.choice(WORDS))
            parts.append(rng.choice(SEPS))
        if rng.random() < 0.5:
            parts.pop()
        out.append("".join(parts))
    # Character-class soup: short random strings over tricky atoms.
    for _ in range(70):
        out.append("".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 12))))
    # Digit runs of every length, with and without separators.
    for k in range(1, 13):
        digits = "".join(rng.choice("0123456789") for _ in range(k))
        out.append(digits)
        out.append(" " + digits + " units")
        out.append(",".join(digits[i:i + 3] for i in range(0, len(digits), 3)))
    # Whitespace runs of each kind before each kind of character.
    for ws in (" ", "\t", "\n", "\r\n", "\u00a0", "\u3000"):
        for count in (1, 2, 3):
            for nxt in ("a", "1", "!", "\u4e2d", ""):
                out.append("x" + ws * count + nxt)
    return out


def corpus_strings():
    rng = random.Random(CORPUS_SEED)
    strings = (PROSE + CODE + NUMBERS + WHITESPACE + MULTILINGUAL + EMOJI + COMBINING +
               CONTRACTIONS + CONTROL + ODD + SPECIALS + LONG + generated(rng))
    seen, unique = set(), []
    for s in strings:
        assert "\x00" not in s, "the C test reads the corpus with cJSON (NUL-terminated strings)"
        if s not in seen:
            seen.add(s)
            unique.append(s)
    return unique


def corpus_text(tokenizers_by_config):
    lines = []
    for s in corpus_strings():
        row = {"text": s}
        for config in CONFIGS:
            row[config] = tokenizers_by_config[config].encode(s, add_special_tokens=False).ids
        lines.append(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing")
    args = ap.parse_args()

    if not os.path.exists(args.model):
        sys.exit(f"{args.model}: not found (run `make model`)")
    g = read_gguf(args.model)
    files, built = {}, {}
    for config in CONFIGS:
        text = tokenizer_json_text(build_tokenizer(g, config), config)
        # Encode with the tokenizer as loaded from the file we write, so the
        # golden ids are exactly what that file means.
        built[config] = Tokenizer.from_str(text)
        files[os.path.join(args.out, config, "tokenizer.json")] = text
    files[os.path.join(args.out, "smollm", "tokenizer_config.json")] = tokenizer_config_text(g)
    files[os.path.join(args.out, "corpus.jsonl")] = corpus_text(built)

    stale = []
    for path, text in files.items():
        if args.check:
            try:
                with open(path, encoding="utf-8") as f:
                    if f.read() != text:
                        stale.append(path)
            except FileNotFoundError:
                stale.append(path)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    if stale:
        sys.exit("stale: " + ", ".join(stale) + " (run tools/gen_tokenizer_golden.py)")
    n = files[os.path.join(args.out, "corpus.jsonl")].count("\n")
    print(f"{'checked' if args.check else 'wrote'} {len(files)} files, corpus {n} strings")


if __name__ == "__main__":
    main()
