"""GSM8K-style arithmetic word problems from templates with seeded random numbers.

GSM8K (Cobbe et al. 2021, arXiv 2110.14168) problems take 2-8 elementary steps (+, -, x, /,
percentages, rates). Spec-Bench's math_reasoning category is drawn from it; these templates write
problems of the same shape without using any GSM8K or Spec-Bench text. Only the question is
produced: the target model writes the (distillation) answer.
"""

from __future__ import annotations

import random

NAMES = ("Maria", "James", "Aisha", "Tom", "Lena", "Carlos", "Priya", "Ben", "Yuki", "Omar", "Sofia", "Daniel",
         "Grace", "Mateo", "Nora", "Ivan", "Chloe", "Kwame", "Emma", "Raj")
ITEMS = (("apples", "apple"), ("pencils", "pencil"), ("cupcakes", "cupcake"), ("books", "book"),
         ("toy cars", "toy car"), ("stickers", "sticker"), ("oranges", "orange"), ("notebooks", "notebook"),
         ("candles", "candle"), ("marbles", "marble"), ("plants", "plant"), ("shirts", "shirt"))
PLACES = ("farm", "bakery", "bookstore", "school fair", "market", "garden center", "library sale", "shop")


def _two_names(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    return a, b


def _shopping(rng):
    name, (items, item) = rng.choice(NAMES), rng.choice(ITEMS)
    n, price, paid = rng.randint(3, 15), rng.randint(2, 12), rng.choice((50, 100, 200))
    return (f"{name} buys {n} {items} at ${price} each and pays with a ${paid} bill. "
            f"How much change does {name} get back?")


def _percent_more(rng):
    name, base, pct = rng.choice(NAMES), rng.randint(4, 60) * 10, rng.choice((10, 20, 25, 30, 40, 50, 75))
    return (f"{name} spends ${base} on supplies for a trip. The tickets cost {pct}% more than the supplies. "
            f"How much does {name} spend on the supplies and the tickets together?")


def _rate_time(rng):
    name, rate, hours, days = rng.choice(NAMES), rng.randint(8, 40), rng.randint(2, 9), rng.randint(3, 6)
    return (f"{name} earns ${rate} an hour and works {hours} hours a day, {days} days a week. "
            f"How much money does {name} earn in 4 weeks?")


def _sharing(rng):
    a, b = _two_names(rng)
    items, _ = rng.choice(ITEMS)
    total, gave = rng.randint(4, 20) * 6, rng.choice((2, 3, 4))
    return (f"{a} has {total} {items}. {a} gives 1/{gave} of them to {b} and then shares the rest equally "
            f"with 2 friends. How many {items} does each friend get?")


def _age(rng):
    a, b = _two_names(rng)
    age, diff, years = rng.randint(5, 30), rng.randint(2, 12), rng.randint(3, 15)
    return (f"{a} is {age} years old and {b} is {diff} years older than {a}. "
            f"How old will they be in total in {years} years?")


def _speed(rng):
    name, speed, hours, extra = rng.choice(NAMES), rng.randint(30, 90), rng.randint(2, 6), rng.randint(10, 80)
    return (f"{name} drives at {speed} miles per hour for {hours} hours and then another {extra} miles. "
            f"How many miles does {name} drive in total?")


def _production(rng):
    place, (items, _) = rng.choice(PLACES), rng.choice(ITEMS)
    per_day, days, sold_pct = rng.randint(20, 200), rng.randint(3, 14), rng.choice((40, 50, 60, 75, 80))
    price = rng.randint(2, 9)
    return (f"A {place} makes {per_day} {items} a day for {days} days. It sells {sold_pct}% of them at ${price} "
            f"each. How much money does the {place} make?")


def _discount(rng):
    name, price, pct, n = rng.choice(NAMES), rng.randint(10, 120), rng.choice((10, 15, 20, 25, 30)), rng.randint(2, 6)
    return (f"A jacket costs ${price}. During a sale it is {pct}% off. {name} buys {n} jackets in the sale. "
            f"How much does {name} pay?")


def _remaining(rng):
    name, (items, _) = rng.choice(NAMES), rng.choice(ITEMS)
    start, day1, day2 = rng.randint(60, 300), rng.randint(5, 30), rng.randint(5, 30)
    return (f"{name} had {start} {items}. On Monday {name} used {day1} of them, and on Tuesday twice as many "
            f"as on Monday. On Wednesday {name} bought {day2} more. How many {items} does {name} have now?")


def _average(rng):
    name, scores = rng.choice(NAMES), [rng.randint(55, 100) for _ in range(rng.randint(3, 5))]
    return (f"{name}'s test scores are {', '.join(map(str, scores[:-1]))} and {scores[-1]}. "
            f"What score does {name} need on the next test to have an average of {rng.randint(75, 95)}?")


def _fractions(rng):
    name, total = rng.choice(NAMES), rng.randint(6, 40) * 12
    return (f"{name} has ${total}. {name} spends a third of it on groceries and a quarter of the rest on a gift. "
            f"How much money does {name} have left?")


def _weekly(rng):
    a, b = _two_names(rng)
    pages, more, days = rng.randint(5, 30), rng.randint(2, 15), rng.randint(5, 14)
    return (f"{a} reads {pages} pages a day. {b} reads {more} pages more than {a} each day. "
            f"How many pages do they read together in {days} days?")


TEMPLATES = (_shopping, _percent_more, _rate_time, _sharing, _age, _speed, _production, _discount, _remaining,
             _average, _fractions, _weekly)


def word_problems(n: int, rng: random.Random) -> list[str]:
    """``n`` word problems (questions only), template and numbers drawn from ``rng``."""
    return [rng.choice(TEMPLATES)(rng) for _ in range(n)]
