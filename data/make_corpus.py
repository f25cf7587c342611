"""Write ``data/fables.txt``, the small text corpus the example trains on.

    .venv/bin/python data/make_corpus.py            # rewrites data/fables.txt (about 300 KB)
    .venv/bin/python data/make_corpus.py --check    # exit 1 if the shipped file differs from what this writes

The fables are generated, not copied: a few plots in the manner of Aesop (a race, a flattering trick, a favour
returned, a summer of idleness, a greedy dog, a boast) told with animals, places and morals drawn from fixed lists by
a seeded random generator. The output is deterministic, so the shipped file can always be checked against this
script. The text is dedicated to the public domain (CC0 1.0), like this script.

Plain English with a small vocabulary and a lot of repeated structure is what a byte-level model of a few million
parameters can learn in a minute on a CPU: its samples start to look like the corpus after about a hundred steps.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path

OUT = Path(__file__).resolve().parent / "fables.txt"
SEED = 1668  # the year La Fontaine's first book of fables appeared
TARGET_BYTES = 300_000

ANIMALS = [
    "fox", "crow", "hare", "tortoise", "lion", "mouse", "ant", "grasshopper", "wolf", "lamb", "dog", "goose", "eagle",
    "frog", "owl", "stork", "cat", "goat", "horse", "donkey", "bear", "deer", "rabbit", "sparrow", "heron", "ox",
]  # fmt: skip
ADJECTIVES = [
    "clever", "proud", "hungry", "patient", "lazy", "humble", "greedy", "kind", "foolish", "wise", "tired", "brave",
    "old", "young", "quick", "slow", "vain", "honest", "sly", "gentle",
]  # fmt: skip
PLACES = [
    "by the river", "in the deep forest", "on the green hill", "at the edge of the wheat field", "near the old mill",
    "under a great oak", "beside the village well", "in the farmer's yard", "on the dusty road", "by the quiet pond",
    "among the rocks", "in the meadow",
]  # fmt: skip
TIMES = [
    "Once upon a time", "Long ago", "One morning", "On a cold winter day", "In the heat of summer", "At dusk",
    "Early one spring", "One bright afternoon", "On a rainy evening", "In the days when animals could speak",
]  # fmt: skip
FOODS = ["a piece of cheese", "a bone", "a bunch of grapes", "a loaf of bread", "a fat worm", "a basket of corn"]
GOALS = [
    "find water", "look for food", "see the king", "gather grain for the winter", "visit my brother",
    "cross the river", "build a new home", "hear the news from the town",
]  # fmt: skip
TROUBLES = [
    "caught in a hunter's net", "stuck in a deep hole", "trapped under a fallen branch", "lost in the snow",
    "tangled in the thorns", "chased by a pack of hounds",
]  # fmt: skip
MORALS = {
    "race": ["Slow and steady wins the race.", "Pride goes before a fall.", "Do not mock those who are slower."],
    "flattery": ["Do not trust flatterers.", "Sweet words often hide a hungry heart.", "Think twice before you sing."],
    "favour": ["Little friends may prove great friends.", "No act of kindness is ever wasted."],
    "summer": ["Work today and you will eat tomorrow.", "It is wise to prepare for the days of need."],
    "greed": ["Grasp at the shadow and you lose the substance.", "Greed often loses what it has."],
    "boast": ["It is easy to be brave from a safe distance.", "Deeds count more than words."],
}


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def capitalize(text: str) -> str:
    return text[0].upper() + text[1:]


def race(rng: random.Random, fast: str, slow: str) -> tuple[str, list[str]]:
    adjective = rng.choice(ADJECTIVES)
    place = rng.choice(PLACES)
    return f"The {capitalize(fast)} and the {capitalize(slow)}", [
        f"{rng.choice(TIMES)}, {article(adjective)} {fast} lived {place}. Every day the {fast} laughed at the {slow} "
        f"for being so slow.",
        f'"Why do you hurry so little?" asked the {fast}. "You will never get anywhere."',
        f'"Let us have a race," said the {slow}, "and we shall see who gets there first."',
        f"The {fast} agreed, and the other animals marked out a course from the old gate to the far side of the hill. "
        f"The {fast} ran off at once and was soon out of sight. Then it thought, "
        f'"There is plenty of time. I will rest a little." It lay down {rng.choice(PLACES)} and fell fast asleep.',
        f"The {slow} did not stop. It went on, step by step, all the day long. When the {fast} woke up, the sun was "
        f"low, and the {slow} had already crossed the line, where all the animals were cheering.",
    ]


def flattery(rng: random.Random, trickster: str, victim: str) -> tuple[str, list[str]]:
    food = rng.choice(FOODS)
    place = rng.choice(PLACES)
    return f"The {capitalize(trickster)} and the {capitalize(victim)}", [
        f"{rng.choice(TIMES)}, {article(victim)} found {food} and sat down {place} to eat it. "
        f"{capitalize(article(rng.choice(ADJECTIVES)))} {trickster} saw it and wanted the food for itself.",
        f'"Good day, dear {victim}," said the {trickster}. "How fine you look today! Your eyes are so bright and your '
        f'coat is so smooth. Surely your voice is the sweetest of all. Will you not sing me a song?"',
        f"The {victim} was pleased to hear such words. It opened its mouth to sing, and down fell {food}. "
        f"The {trickster} picked it up at once.",
        f'"Thank you," said the {trickster}. "You have a voice, it is true, but you have no sense." '
        f"And it went away {rng.choice(PLACES)} to eat.",
    ]


def favour(rng: random.Random, big: str, small: str) -> tuple[str, list[str]]:
    trouble = rng.choice(TROUBLES)
    return f"The {capitalize(big)} and the {capitalize(small)}", [
        f"{rng.choice(TIMES)}, {article(rng.choice(ADJECTIVES))} {big} was sleeping {rng.choice(PLACES)} when "
        f"{article(small)} ran over its nose and woke it up. The {big} caught the {small} and was about to eat it.",
        f'"Please let me go," cried the {small}. "One day I may be able to help you."',
        f"The {big} laughed, for it did not believe that so small a creature could ever help it. "
        f"But it was not hungry, so it let the {small} go.",
        f"Some days later the {big} was {trouble}. It called for help, but nobody came. Then the {small} heard it "
        f"and came running. It worked all night, and at last the {big} was free.",
        f'"You laughed at me," said the {small}, "but now you see that even a small friend can help a great one."',
    ]


def summer(rng: random.Random, idle: str, busy: str) -> tuple[str, list[str]]:
    return f"The {capitalize(busy)} and the {capitalize(idle)}", [
        f"{rng.choice(TIMES)}, {article(idle)} spent the long summer days singing {rng.choice(PLACES)}. "
        f"Nearby {article(busy)} worked from morning till night, carrying food to its home.",
        f'"Why do you work so hard?" asked the {idle}. "Come and sing with me. There is food everywhere."',
        f'"I am storing food for the winter," said the {busy}, "and I think you should do the same."',
        f"The {idle} only laughed and went on singing. When the cold came and the snow covered the ground, the {idle} "
        f"had nothing to eat. It went to the {busy} and begged for a little food.",
        f'"You sang all summer," said the {busy}. "Now you must dance all winter." '
        f"But in the end it gave the {idle} a little food, and the {idle} never forgot the lesson.",
    ]


def greed(rng: random.Random, animal: str, _other: str) -> tuple[str, list[str]]:
    food = rng.choice(FOODS)
    return f"The {capitalize(animal)} and Its Reflection", [
        f"{rng.choice(TIMES)}, {article(rng.choice(ADJECTIVES))} {animal} was carrying {food} home. On the way it had "
        f"to cross a narrow bridge {rng.choice(PLACES)}.",
        f"Looking down into the water, the {animal} saw another {animal} with {food} of its own, and it seemed "
        f"twice as large. The {animal} wanted that one too, so it opened its mouth to take it.",
        f"At once its own {food.split(' ', 1)[1]} fell into the water and was carried away. The {animal} went home "
        f"with nothing at all.",
    ]


def boast(rng: random.Random, boaster: str, witness: str) -> tuple[str, list[str]]:
    return f"The Boastful {capitalize(boaster)}", [
        f"{rng.choice(TIMES)}, {article(rng.choice(ADJECTIVES))} {boaster} came home from a long journey and told "
        f"everyone {rng.choice(PLACES)} about the great things it had done.",
        '"In the far country," it said, "I jumped higher than any animal alive. Everyone there saw me do it."',
        f'The {witness} listened for a while and then said, "There is no need to go so far. Suppose this is the far '
        f'country. Show us your jump here."',
        f"The {boaster} looked at the ground and said nothing more, and the others went back to {rng.choice(GOALS)}.",
    ]


PLOTS: dict[str, Callable[[random.Random, str, str], tuple[str, list[str]]]] = {
    "race": race,
    "flattery": flattery,
    "favour": favour,
    "summer": summer,
    "greed": greed,
    "boast": boast,
}


def fable(rng: random.Random, number: int) -> str:
    kind = rng.choice(sorted(PLOTS))
    first, second = rng.sample(ANIMALS, 2)
    title, paragraphs = PLOTS[kind](rng, first, second)
    moral = rng.choice(MORALS[kind])
    return f"{number}. {title}\n\n" + "\n\n".join(paragraphs) + f"\n\nMoral: {moral}\n\n\n"


def corpus() -> str:
    rng = random.Random(SEED)
    parts: list[str] = []
    size = 0
    while size < TARGET_BYTES:
        parts.append(fable(rng, len(parts) + 1))
        size += len(parts[-1])
    return "".join(parts)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args(argv)
    text = corpus()
    if args.check:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date. HINT: run `python {Path(__file__).name}` to rewrite it.", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT} ({len(text.encode()):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
