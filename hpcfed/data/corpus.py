"""Text corpora for SEEC (doc2vec): 20 Newsgroups, users' own documents, gensim's test corpora.

Every loader returns a list of `Document` (id, text, optional label). Tokenisation is gensim's
``simple_preprocess`` (lower-case, 2..15 letters), as in the SEEC reference code.

Users' documents come in one of two formats, chosen by the file suffix:

* ``.jsonl`` — one JSON object per line: ``{"id": "doc-17", "text": "...", "label": 3}``;
  ``id`` and ``text`` are required (id: a non-empty string or integer, unique in the file),
  ``label`` is optional (a class name such as ``"earn"``, or an integer; used for label
  precision@k and shown in search results). Integer labels keep their values; where some label is
  a name, the names are numbered in sorted order (numbers in numeric order) and each document keeps
  its name in ``group``.
* anything else (``.txt``) — plain text, one document per line; the id is the 0-based line number.
  Empty lines are kept as empty documents so that ids stay line numbers.

20 Newsgroups is read straight from ``text/20news-bydate.tar.gz`` under the data root (no
extraction): ``20news-bydate-{train,test}/<group>/<id>``, latin-1 Usenet posts. `clean_post`
applies scikit-learn's ``fetch_20newsgroups(remove=...)`` rules: ``headers`` (everything up to the
first blank line; the default, because the ``Newsgroups:`` and ``Path:`` lines give the label
away), ``quotes`` (lines quoting other posts: ``>``, ``|``, "... writes:"), ``footers`` (the last
block after a blank or ``--`` line, usually a signature). ``keep_subject`` puts the post's
``Subject:`` line back in front of the body (the subject is written by the author, like the body).
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcfed.data.root import DataError, dataset_dir

NEWSGROUPS_ARCHIVE = "20news-bydate.tar.gz"

# The six topical families of the 20 groups (the grouping of the dataset's own home page).
NEWSGROUP_FAMILIES: dict[str, str] = {
    "comp.graphics": "comp", "comp.os.ms-windows.misc": "comp", "comp.sys.ibm.pc.hardware": "comp",
    "comp.sys.mac.hardware": "comp", "comp.windows.x": "comp",
    "rec.autos": "rec", "rec.motorcycles": "rec", "rec.sport.baseball": "rec", "rec.sport.hockey": "rec",
    "sci.crypt": "sci", "sci.electronics": "sci", "sci.med": "sci", "sci.space": "sci",
    "misc.forsale": "misc",
    "talk.politics.misc": "politics", "talk.politics.guns": "politics", "talk.politics.mideast": "politics",
    "talk.religion.misc": "religion", "alt.atheism": "religion", "soc.religion.christian": "religion",
}
NEWSGROUPS = sorted(NEWSGROUP_FAMILIES)
REMOVABLE = ("headers", "quotes", "footers")
# scikit-learn's _QUOTE_RE (sklearn/datasets/_twenty_newsgroups.py): a line that quotes another post.
_QUOTE_RE = re.compile(r"(writes in|writes:|wrote:|says:|said:|^In article|^Quoted from|^\||^>)")


@dataclass(frozen=True)
class Document:
    """One text document: id, text, class label (-1 unlabelled) and, for 20NG, its newsgroup."""

    id: str
    text: str
    label: int = -1  # -1 = unlabelled
    group: str = ""  # 20NG: the newsgroup name; a user corpus: the label's name


def tokenize(text: str) -> list[str]:
    """gensim ``simple_preprocess``: lower-case alphabetic tokens of 2..15 characters."""
    from gensim.utils import simple_preprocess

    tokens: list[str] = simple_preprocess(text)
    return tokens


# -- 20 Newsgroups -----------------------------------------------------------------------------------
def load_20newsgroups(data_root: str | Path | None = None, *, subset: str = "all",
                      remove: Sequence[str] = ("headers",), keep_subject: bool = False,
                      max_docs: int | None = None, seed: int = 0) -> list[Document]:
    """The 20 Newsgroups posts of `subset` (``train``, ``test`` or ``all``), label = index in `NEWSGROUPS`.

    Ids are ``"<split>/<group>/<file>"``; the text is `clean_post(raw, remove, keep_subject)`.
    `max_docs` keeps a random (seeded) sample, for quick runs.
    """
    if subset not in ("train", "test", "all"):
        raise ValueError(f"20 Newsgroups subset={subset!r}; choose train, test or all")
    check_remove(remove)
    path = dataset_dir("text", data_root) / NEWSGROUPS_ARCHIVE
    if not path.is_file():
        raise DataError(f"{path} not found; set HPCFED_DATA to the folder holding text/{NEWSGROUPS_ARCHIVE}")
    wanted = ("train", "test") if subset == "all" else (subset,)
    docs: list[Document] = []
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:  # sequential read: one pass over the gzip stream
            if not member.isfile():
                continue
            parts = member.name.split("/")
            if len(parts) != 3 or not parts[0].startswith("20news-bydate-"):
                continue
            split, group, name = parts[0].rsplit("-", 1)[1], parts[1], parts[2]
            if split not in wanted:
                continue
            if group not in NEWSGROUP_FAMILIES:
                raise DataError(f"{path}: unknown newsgroup folder {group!r} in {member.name}")
            fh = tar.extractfile(member)
            if fh is None:  # tarfile gives None only for links and folders, skipped above
                raise DataError(f"{path}: cannot read {member.name} from the archive")
            with fh:
                raw = fh.read().decode("latin-1")
            text = clean_post(raw, remove, keep_subject)
            docs.append(Document(f"{split}/{group}/{name}", text, NEWSGROUPS.index(group), group))
    if not docs:
        raise DataError(f"{path}: no posts found under 20news-bydate-{'/'.join(wanted)}")
    docs.sort(key=lambda d: d.id)  # archive order is not guaranteed; ids are
    return sample(docs, max_docs, seed)


def check_remove(remove: Sequence[str], where: str = "remove") -> None:
    """Raise ValueError naming the option `where` unless every part in `remove` is in REMOVABLE."""
    bad = [r for r in remove if r not in REMOVABLE]
    if bad:
        raise ValueError(f"{where}={list(remove)}: unknown part(s) {bad}; choose from {list(REMOVABLE)}")


def clean_post(raw: str, remove: Sequence[str] = ("headers",), keep_subject: bool = False) -> str:
    """One Usenet post with the `remove` parts dropped (scikit-learn's rules), optionally its subject in front."""
    head, sep, body = raw.partition("\n\n")
    if not sep:  # no header block
        head, body = "", raw
    subject = next((line[len("subject:"):].strip() for line in head.split("\n")
                    if line.lower().startswith("subject:")), "")
    text = body if "headers" in remove else raw
    if "quotes" in remove:
        text = "\n".join(line for line in text.split("\n") if not _QUOTE_RE.search(line))
    if "footers" in remove:
        text = _strip_footer(text)
    if keep_subject and "headers" in remove and subject:
        text = subject + "\n" + text
    return text


def _strip_footer(text: str) -> str:
    # sklearn's strip_newsgroup_footer: cut at the last line that is blank or only dashes.
    lines = text.strip().split("\n")
    for num in range(len(lines) - 1, -1, -1):
        if lines[num].strip().strip("-") == "":
            break
    return "\n".join(lines[:num]) if num > 0 else text


# -- splitting across sites ----------------------------------------------------------------------------
def split_documents(docs: Sequence[Document], num_sites: int, *, mode: str = "random",
                    seed: int = 0) -> list[list[Document]]:
    """Assign documents to `num_sites` sites.

    ``random``: a seeded permutation dealt out in equal shares. ``family``: every newsgroup family
    (`NEWSGROUP_FAMILIES`; unknown groups form their own family) goes whole to one site, families
    dealt largest first to the site with the fewest documents, so sites see different topics.
    """
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")
    if mode == "random":
        order = np.random.default_rng(seed).permutation(len(docs))
        return [[docs[i] for i in sorted(order[s::num_sites])] for s in range(num_sites)]
    if mode == "family":
        families: dict[str, list[Document]] = {}
        for d in docs:
            families.setdefault(NEWSGROUP_FAMILIES.get(d.group, d.group or "unlabelled"), []).append(d)
        if len(families) < num_sites:
            raise ValueError(f"split=family: {len(families)} families for {num_sites} sites; use split=random")
        sites: list[list[Document]] = [[] for _ in range(num_sites)]
        for name in sorted(families, key=lambda f: (-len(families[f]), f)):
            min(sites, key=len).extend(families[name])
        return [sorted(s, key=lambda d: d.id) for s in sites]
    raise ValueError(f"split={mode!r}; choose random or family")


# -- users' documents ------------------------------------------------------------------------------------
def load_corpus_file(path: str | Path) -> list[Document]:
    """Read a user corpus: JSONL (``id``, ``text``, optional ``label``) or plain text (one doc per line)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"corpus file {path} does not exist")
    docs: list[Document] = []
    with path.open(encoding="utf-8") as f:
        if path.suffix.lower() != ".jsonl":
            return [Document(str(i), line.rstrip("\n")) for i, line in enumerate(f)]
        seen: set[str] = set()
        named = False  # some label is a class name, not an integer
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg}); each line must be one object") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object with 'id' and 'text'")
            doc_id, text, label = obj.get("id"), obj.get("text"), obj.get("label", -1)
            if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or str(doc_id) == "":
                raise DataError(f"{path}:{lineno}: field 'id' must be a non-empty string or integer")
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: field 'text' must be a string")
            if label is None:
                label = -1
            if isinstance(label, bool) or not isinstance(label, (int, str)) or label == "":
                raise DataError(f"{path}:{lineno}: field 'label' must be a class name or an integer (or absent), "
                                f"got {label!r}")
            if str(doc_id) in seen:
                raise DataError(f"{path}:{lineno}: duplicate id {doc_id!r}; ids must be unique")
            seen.add(str(doc_id))
            docs.append(Document(str(doc_id), text, -1, "" if label == -1 else str(label)))
            named = named or isinstance(label, str)
    if not named:  # integer labels keep their values
        return [Document(d.id, d.text, int(d.group) if d.group else -1) for d in docs]
    names = label_order({d.group for d in docs if d.group})
    code = {name: c for c, name in enumerate(names)}
    return [Document(d.id, d.text, code[d.group], d.group) if d.group else d for d in docs]


def label_order(names: set[str]) -> list[str]:
    """Class names in the order they are numbered: integers numerically, other names alphabetically."""
    if all(n.lstrip("-").isdigit() for n in names):
        return sorted(names, key=int)
    return sorted(names)


def label_names(docs: Sequence[Document]) -> list[str]:
    """Name of each label 0..max (the newsgroup or the corpus's class name; "" where none is known)."""
    top = max((d.label for d in docs), default=-1)
    names = [""] * (top + 1)
    for d in docs:
        if d.label >= 0 and d.group:
            names[d.label] = d.group
    return names


def sample(docs: list[Document], max_docs: int | None, seed: int) -> list[Document]:
    """A seeded random sample of `max_docs` documents, in corpus order (all when None or fewer)."""
    if max_docs is None or max_docs >= len(docs):
        return docs
    keep = np.sort(np.random.default_rng(seed).choice(len(docs), size=max_docs, replace=False))
    return [docs[i] for i in keep]


def gensim_test_corpus(name: str = "lee_background.cor") -> list[Document]:
    """A corpus bundled with gensim's tests (``lee_background.cor``: 300 news articles; ``lee.cor``)."""
    from gensim.test.utils import datapath

    path = Path(datapath(name))
    if not path.is_file():
        raise DataError(f"gensim test corpus {name!r} not found at {path}")
    with path.open(encoding="latin-1") as f:
        return [Document(str(i), line.strip()) for i, line in enumerate(f)]


def iter_tokens(docs: Iterable[Document]) -> Iterable[list[str]]:
    """The tokens of each document in turn, one list per document, produced lazily."""
    for d in docs:
        yield tokenize(d.text)
