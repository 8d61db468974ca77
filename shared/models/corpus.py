"""A small built-in English corpus for training the checkpoint tokenizer without downloads:
hand-written paragraphs, and fixed-seed sentences drawn from a word list."""

from __future__ import annotations

import random

_PARAGRAPHS = (
    "Once upon a time, in a small village at the edge of a great forest, there lived a girl "
    "named Lily. Every morning she walked to the river to fetch water, and every evening she "
    "told her little brother stories about the animals she had seen: a fox with a bushy tail, "
    "a family of ducks, and an old owl who never seemed to sleep.",
    "The weather changed quickly that autumn. Cold winds came down from the mountains, the "
    "leaves turned red and gold, and farmers hurried to bring in the last of the harvest before "
    "the first frost. In the market, people traded apples, bread, cheese, wool and honey.",
    "Computers read and write numbers much faster than people do. A program is a list of "
    "instructions; the machine follows them one after another, storing results in memory and "
    "reading them back when they are needed. Good programs are clear, tested and easy to change.",
    "Hello! How are you today? I am fine, thank you. Could you help me find the library? It is "
    "next to the station, across the street from the bakery. Please remember to return the "
    "books by Friday, or you will have to pay a small fee.",
    "Science begins with questions. Why is the sky blue? How do birds know where to fly in "
    "winter? What makes a seed grow into a tree? Scientists observe the world, form ideas, run "
    "experiments, measure the results carefully, and share what they learn with others.",
    "The assistant answered each question politely and briefly. When the user asked for a "
    "recipe, it listed the ingredients first: two cups of flour, one egg, a pinch of salt, "
    "half a cup of milk and a spoon of sugar. Then it explained each step in order.",
)

# Split at use: a literal list of 500 quoted words would be unreadable.
_WORD_TEXT = (
    "the be to of and a in that have it for not on with he as you do at this but his by from "
    "they we say her she or an will my one all would there their what so up out if about who "
    "get which go me when make can like time no just him know take people into year your good "
    "some could them see other than then now look only come its over think also back after use "
    "two how our work first well way even new want because any these give day most us is was "
    "are were been has had did said made went found thought told asked seemed felt became left "
    "kept began showed heard played ran moved lived believed brought happened wrote provided "
    "sat stood lost paid met included continued set learned changed led understood watched "
    "followed stopped created spoke read allowed added spent grew opened walked won offered "
    "remembered loved considered appeared bought waited served died sent expected built stayed "
    "fell cut reached killed remained suggested raised passed sold required reported decided "
    "pulled house world school state family student group country problem hand part place case "
    "week company system program question government number night point home water room mother "
    "area money story fact month lot right study book eye job word business issue side kind "
    "head service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research girl guy moment "
    "air teacher force education foot boy age policy process music market sense nation plan "
    "college interest death experience effect class control care field development role effort "
    "rate heart drug show leader light voice wife police mind price report decision son view "
    "relationship town road arm difference value building action model season society tax "
    "director position player record paper space ground form event official matter center "
    "couple site project activity star table need court oil situation cost industry figure "
    "street image phone data picture practice piece land product doctor wall patient worker "
    "news test movie north love support technology step baby computer type attention film tree "
    "source organization hair window evidence population truth song energy garden river forest "
    "mountain ocean island village castle dragon princess kitten puppy rabbit turtle butterfly "
    "happy sad angry brave quiet loud bright dark warm cold soft hard little big small large "
    "young old early late quick slow strong weak rich poor clean dirty simple difficult easy "
    "beautiful wonderful important different possible available popular traditional national "
    "political economic social international natural physical environmental financial personal "
    "quickly slowly carefully happily suddenly finally usually really always never sometimes "
    "often together already almost perhaps especially probably certainly simply exactly"
)


def training_corpus() -> list[str]:
    """Deterministic: the same list of lines on every call and in every process."""
    rng = random.Random(0)
    vocabulary = _WORD_TEXT.split()
    lines = list(_PARAGRAPHS)
    for _ in range(400):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(6, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice((".", ".", "!", "?")))
    lines.extend(f"{n} + {n * 7 % 100} = {n + n * 7 % 100}" for n in range(0, 1000, 7))
    return lines
