"""User turns for drafter training data besides the ones the target writes itself (``make-data --mix``).

A drafter accepts deep only on text like the text it was trained on; a 135M target asked to write user turns writes
mostly short chat questions, while the evaluation prompts are instructions, code problems, extraction and multi-step
reasoning. :class:`PromptMixer` draws, with fixed weights and one seeded stream, from:

* ``template``: a task template filled with a topic (writing, role play, reasoning, STEM, humanities, advice,
  comparison, planning, editing, classification) — the template and topic lists below;
* ``math``: arithmetic, algebra, percentages and word problems with random numbers (answers need steps);
* ``code``: a documented Python function of the interpreter's standard library (and of ``packages``, e.g. numpy),
  shown as its signature and docstring (write it) or as its source (explain, test, document or review it);
* ``passage``: a long module or class docstring of the same files as a text to summarise, question or extract from.

Every source is deterministic given the seed and the Python installation (the files in sorted order); :meth:`PromptMixer.fingerprint` names that installation in the data manifest. The eval-leak check and the
deduplication of ``make-data`` apply to these turns as to the target's own.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import random
import sys
import sysconfig
import threading
from pathlib import Path

SOURCES = ("self", "template", "math", "code", "passage")
DEFAULT_MIX = {"self": 0.3, "template": 0.25, "math": 0.1, "code": 0.25, "passage": 0.1}

TOPICS = [
    "the water cycle", "photosynthesis", "black holes", "the French Revolution", "machine learning", "climate change",
    "the Roman Empire", "volcanoes", "the human heart", "electric cars", "renewable energy", "the stock market",
    "inflation", "vaccines", "the Internet", "social media", "honeybees", "the Moon landing", "plate tectonics",
    "the printing press", "jazz music", "the Olympic Games", "coffee", "chess", "sleep", "meditation", "recycling",
    "urban gardening", "remote work", "time management", "public speaking", "the immune system", "DNA", "gravity",
    "quantum computing", "cryptography", "blockchain", "the Renaissance", "ancient Egypt", "the Silk Road",
    "the Industrial Revolution", "World War I", "the Cold War", "democracy", "supply and demand", "compound interest",
    "budgeting", "healthy eating", "marathon training", "learning a language", "rainforests", "coral reefs",
    "deserts", "the ocean tides", "earthquakes", "hurricanes", "the solar system", "Mars exploration",
    "artificial intelligence ethics", "self-driving cars", "3D printing", "nuclear energy", "wind turbines",
    "the periodic table", "chemical reactions", "evolution", "dinosaurs", "antibiotics", "mental health",
    "friendship", "leadership", "teamwork", "customer service", "starting a small business", "marketing",
    "job interviews", "writing a resume", "negotiation", "online privacy", "password security", "open-source software",
    "cloud computing", "databases", "operating systems", "computer networks", "video games", "film making",
    "photography", "painting", "poetry", "Shakespeare", "Greek mythology", "the Great Wall of China", "Mount Everest",
    "the Amazon river", "migration of birds", "cats", "dogs", "elephants", "octopuses", "bread baking", "tea",
    "chocolate", "the history of money", "banks", "taxes", "electric circuits", "magnets", "light and color", "sound",
    "the speed of light", "relativity", "probability", "statistics", "prime numbers", "geometry", "calculus",
    "the Pythagorean theorem", "traffic in big cities", "public transport", "bicycles", "air travel", "tourism",
    "hiking safety", "camping", "first aid", "fire safety", "home organisation", "minimalism", "habits",
    "procrastination", "motivation", "online learning", "homework", "exams", "libraries", "museums", "architecture",
    "bridges", "skyscrapers", "smartphones", "batteries", "semiconductors", "robots", "space telescopes", "satellites",
    "weather forecasting", "clouds", "snow", "the seasons", "volunteering", "charity", "human rights", "free speech",
    "the scientific method", "critical thinking", "logical fallacies", "debate", "philosophy of mind", "ethics",
    "happiness", "gratitude", "family traditions", "holidays", "wedding planning", "moving to a new city",
    "pets and allergies", "gardening tomatoes", "composting", "water conservation", "plastic pollution",
]

TEMPLATES = [
    # writing
    "Write a short blog post about {topic}.", "Write a persuasive essay arguing for more attention to {topic}.",
    "Compose a poem about {topic}.", "Write a short story in which {topic} plays a central role.",
    "Write a formal email to a colleague about {topic}.", "Draft a speech for a school event about {topic}.",
    "Write a product description for a new book about {topic}.", "Write a haiku about {topic}.",
    "Write a limerick about {topic}.", "Write a news headline and a short article about {topic}.",
    # role play
    "Pretend you are a tour guide and introduce {topic} to visitors.",
    "Imagine you are a teacher. Explain {topic} to a class of ten-year-olds.",
    "Act as a job interviewer and ask me three questions related to {topic}.",
    "You are a scientist being interviewed on the radio. Answer: why does {topic} matter?",
    # explanation, STEM, humanities
    "Explain {topic} in simple terms.", "What are the main causes and effects of {topic}?",
    "Give me five interesting facts about {topic}.", "What are common misconceptions about {topic}?",
    "Describe the history of {topic} in a few paragraphs.", "How would you explain {topic} to a beginner?",
    "What are the advantages and disadvantages of {topic}?", "Summarize the key ideas behind {topic}.",
    "What questions do researchers still ask about {topic}?", "Why is {topic} important today?",
    "Create a study guide with key terms and definitions for {topic}.",
    "Write a multiple-choice quiz with four questions about {topic}, and give the answers.",
    # reasoning, comparison, planning
    "Compare {topic} and {topic2}. How are they similar and how are they different?",
    "Which is more important for the future, {topic} or {topic2}? Explain your reasoning step by step.",
    "Make a step-by-step plan for a beginner who wants to learn about {topic}.",
    "Outline a one-week project for students about {topic}.",
    "List the pros and cons of a city investing heavily in {topic}.",
    "Give three arguments for and three arguments against focusing on {topic}.",
    # advice
    "I want to get better at {topic}. What should I do first?", "Give me practical tips related to {topic}.",
    "What are the most common mistakes people make with {topic}, and how can they be avoided?",
    # editing and classification
    "Rewrite the following sentence to be more formal: \"{topic} is kind of a big deal these days.\"",
    "Classify the topic \"{topic}\" as science, history, art, economics or everyday life, and explain why.",
    "Suggest five titles for an article about {topic}.", "Write a tweet announcing an event about {topic}.",
    "Create an outline for a presentation about {topic} with an introduction, three sections and a conclusion.",
]

CODE_WRITE = [
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{stub}\n```",
    "Complete the following Python function:\n```python\n{stub}\n```",
    "Implement this function in Python:\n\n```python\n{stub}\n```",
    "Here is a Python function signature with a docstring. Write the body.\n```python\n{stub}\n```",
]
CODE_READ = [
    "Explain what the following Python code does:\n```python\n{code}\n```",
    "Write unit tests for this Python function:\n```python\n{code}\n```",
    "Review this code and suggest improvements:\n```python\n{code}\n```",
    "Add comments to the following code to explain each step:\n```python\n{code}\n```",
    "What is the time complexity of this function? Explain.\n```python\n{code}\n```",
    "Rewrite this function to be simpler and more readable:\n```python\n{code}\n```",
]
PASSAGE = [
    "Summarize the following text in two or three sentences.\n\n{text}",
    "Read the text below and list its key points as bullet points.\n\n{text}",
    "Extract every technical term from the following text and define each one briefly.\n\n{text}",
    "Write three questions that the following text answers, and answer them.\n\n{text}",
    "Explain the following documentation to a beginner.\n\n{text}",
    "Turn the following text into a short JSON object with the fields \"topic\" and \"summary\".\n\n{text}",
]

_NAMES = ["Alice", "Bob", "Maria", "Omar", "Lena", "Kenji", "Priya", "Tom", "Sara", "Diego"]
_ITEMS = ["apples", "books", "pencils", "tickets", "cookies", "marbles", "stamps", "shirts", "plants", "cards"]


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 30)
    name, other, item = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(10)
    if kind == 0:
        return f"What is {a * c} times {b}? Show your work."
    if kind == 1:
        return f"Solve for x: {c}x + {a} = {c * b + a}. Explain each step."
    if kind == 2:
        return f"What is {rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 75])}% of {a * 20}? Explain how you got it."
    if kind == 3:
        return (f"{name} has {a} {item}. {name} gives {min(a - 1, c)} of them to {other} and then buys {b} more. "
                f"How many {item} does {name} have now?")
    if kind == 4:
        return (f"A train travels {a * 10} km in {c} hours. What is its average speed? How far would it go in "
                f"{b} hours at the same speed?")
    if kind == 5:
        return f"Find the area and the perimeter of a rectangle that is {a} cm long and {c} cm wide."
    if kind == 6:
        return f"Is {a * 100 + b} a prime number? Explain how to check."
    if kind == 7:
        return (f"{name} saves ${c} every week. How many weeks does it take to save ${c * a}? "
                f"Think step by step.")
    if kind == 8:
        return f"Simplify the fraction {a * c}/{b * c} and convert it to a decimal."
    return f"Solve the system of equations: x + y = {a + b}, x - y = {a - b}."


class PromptMixer:
    """Seeded stream of ``(source, user turn)`` pairs from the non-``self`` sources of ``weights``."""

    def __init__(self, seed: int, weights: dict[str, float] | None = None, packages: tuple[str, ...] = (),
                 max_code_lines: int = 40, max_passage_chars: int = 1500):
        self.weights = check_mix(dict(DEFAULT_MIX if weights is None else weights))
        self.rng = random.Random(seed)
        self.roots = (Path(sysconfig.get_paths()["stdlib"]), *(_package_root(name) for name in packages))
        self.max_code_lines, self.max_passage_chars = max_code_lines, max_passage_chars
        self._functions: list[tuple[str, str]] | None = None  # (stub, source)
        self._passages: list[str] | None = None
        self.mixed = {k: v for k, v in self.weights.items() if k != "self" and v > 0}
        # parse the files while the caller starts generating (seconds of CPU for a large package)
        self._scanner = None
        if {"code", "passage"} & set(self.mixed):
            self._scanner = threading.Thread(target=self._scan, daemon=True)
            self._scanner.start()

    @property
    def self_fraction(self) -> float:
        """Share of user turns the target should write itself."""
        return self.weights.get("self", 0.0) / sum(self.weights.values())

    def _scan(self):
        if self._functions is not None:
            return
        found = [_library(root, self.max_code_lines, self.max_passage_chars) for root in self.roots]
        self._functions = [f for functions, _ in found for f in functions]
        self._passages = [p for _, passages in found for p in passages]

    def _wait(self):
        if self._scanner is not None:
            self._scanner.join()
        self._scan()

    def fingerprint(self) -> dict:
        """What the ``code``/``passage`` sources draw from (for the data manifest)."""
        self._wait()
        digest = hashlib.sha256("\n".join(s for s, _ in self._functions).encode()).hexdigest()[:16]
        return {"roots": [str(r) for r in self.roots], "python": sys.version.split()[0],
                "functions": len(self._functions),
                "passages": len(self._passages), "functions_sha256_16": digest}

    def sample(self) -> tuple[str, str]:
        """One ``(source, user turn)`` from the mixed (non-``self``) sources."""
        if not self.mixed:
            raise ValueError("the mix has no source besides 'self'")
        rng = self.rng
        source = rng.choices(list(self.mixed), weights=list(self.mixed.values()))[0]
        if source == "template":
            topic, topic2 = rng.sample(TOPICS, 2)
            return source, rng.choice(TEMPLATES).format(topic=topic, topic2=topic2)
        if source == "math":
            return source, _math(rng)
        self._wait()
        if source == "code":
            stub, code = rng.choice(self._functions)
            if rng.random() < 0.5:
                return source, rng.choice(CODE_WRITE).format(stub=stub)
            return source, rng.choice(CODE_READ).format(code=code)
        return source, rng.choice(PASSAGE).format(text=rng.choice(self._passages))


def _package_root(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"--code-packages: {name!r} is not an installed package")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=8)
def _library(root: Path, max_code_lines: int, max_passage_chars: int) -> tuple[tuple, tuple]:
    """Documented public functions ``(stub, source)`` and long docstrings of the Python files under ``root`` (read
    once per process: parsing the standard library takes seconds)."""
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "ensurepip"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    functions, passages = [], []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):  # the module itself first
            if isinstance(node, (ast.Module, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= 60:
                    passages.append(doc[:max_passage_chars])
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = node.body[0] if node.body else None
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str) and len(doc.value.value.split()) >= 5):
                continue
            if node.end_lineno - node.lineno + 1 > max_code_lines or len(node.body) < 2:
                continue
            first = node.lineno - 1 - len(node.decorator_list)
            body = lines[first: node.end_lineno]
            indent = len(body[0]) - len(body[0].lstrip())
            body = [line[indent:] for line in body]
            stub = body[: doc.end_lineno - first]
            functions.append(("\n".join(stub), "\n".join(body)))
    if not functions or not passages:
        raise RuntimeError(f"no documented functions or passages found under {root}")
    return tuple(functions), tuple(passages)


def parse_mix(text: str | None) -> dict[str, float]:
    """``"self=0.3,code=0.25,..."`` → weights (``None``/empty: :data:`DEFAULT_MIX`)."""
    if not text:
        return dict(DEFAULT_MIX)
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--mix wants name=weight pairs separated by commas, got {part!r}") from None
    return check_mix(out)


def check_mix(weights: dict[str, float]) -> dict[str, float]:
    unknown = set(weights) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown prompt sources {sorted(unknown)}; known: {list(SOURCES)}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"prompt source weights must be >= 0 with a positive sum, got {weights}")
    return weights


__all__ = ["DEFAULT_MIX", "SOURCES", "PromptMixer", "parse_mix"]
