"""Word lists for the generated tasks (our own lists; nothing is downloaded).

Keys are "adjective-noun" pairs as in RULER; values and record fields draw from the other lists. The lists avoid
the words of the task templates ("special", "magic", "number", "words", ...) so that a template can never
supply an expected answer.
"""

ADJECTIVES = """
able acid aged airy ample angry arctic ashen bald bare bitter blunt bold bony brave brief brisk broad bumpy
calm candid cheap chilly civil clean clever cloudy coarse cold cosmic crisp cruel curly damp dapper dark dear
deep dense dizzy dry dull dusty eager early earthy easy elder empty equal even exotic faint fair false famous
fancy fast fierce filthy firm flat fluffy fond frail free fresh frosty frozen funny fuzzy gentle giant glad
gloomy glossy golden grand greedy grumpy hairy happy hard harsh hasty heavy hollow honest humble hungry icy
idle jolly juicy keen kind lame large lazy lean little lively lone loud lucky lush mad mellow mighty mild
misty modern moist narrow neat nervous nimble noble noisy odd oily old pale plain plump polite poor proud quick
quiet rapid rare raw rich rigid ripe rough round royal rusty sad safe salty sandy scary shaggy sharp shiny
short shy silent silky silly sleepy slim slow small smart smooth soft solid sour sparse spicy stale steady
steep sticky stiff stormy strict strong sturdy sunny sweet swift tall tame tender thick thin tidy tiny tired
tough upset vast vivid wary weak weary wet wide wild windy wise witty wooden young zany
""".split()

NOUNS = """
acorn anchor apple apron arrow attic badge bagel ball banjo barn basket beacon bean beard bell bench berry
bicycle blanket blossom boat bone boot bottle boulder bow bowl box bracelet branch bread brick bridge broom
brush bubble bucket buckle button cabin cable cactus cake camel candle canoe canyon cap carpet carrot castle
cat cave cellar chair chalk cherry chimney circus clock cloud coat coconut coin comet compass cookie copper
cottage crab crayon crown cup curtain cushion daisy desk diamond dolphin donkey door dragon drum eagle engine
falcon feather fence fern fiddle flag flute fork fossil fountain fox garden garlic gate ginger glove goose
grape guitar hammer harbor hat hawk helmet hill honey horse island jacket jar jelly kettle kite ladder lake
lamp lantern lemon lily lion lizard lobster locket magnet mango maple meadow melon mirror mitten moon moose
mountain mouse mug needle nest oak olive onion orchard otter owl paddle palace panda parrot peach peanut pearl
pebble pencil pepper piano pickle pillow pine pirate plum pocket pony potato puddle pumpkin puzzle quilt rabbit
raft rainbow raven ribbon river robin rocket rose saddle salmon sandal scarf seal shell shovel silver skate
sled snail sock spoon squirrel stamp star statue stone stove sugar swan sword table teapot tiger tomato torch
tower tractor trumpet tulip turnip turtle umbrella valley violin wagon walnut whale wheel whistle willow window
wolf yacht zebra
""".split()

FIRST_NAMES = """
Ada Alma Arlo Bea Bruno Cora Dario Edith Elio Esme Felix Freya Gus Hana Ines Ivan Jonas Kira Lars Lena Lotte
Mara Milo Nadia Nils Olga Omar Pia Quinn Rosa Rui Sami Sven Tara Theo Uma Vera Wim Yara Zoe
""".split()

LAST_NAMES = """
Abbott Baker Castillo Dahl Eriksen Fontaine Garcia Horvat Ivanova Jensen Kowalski Lindqvist Moreau Novak
Okafor Petrov Quist Rossi Santos Tanaka Ueda Varga Weber Xu Yilmaz Zimmer
""".split()

CITIES = """
Lisbon Oslo Porto Bergen Ghent Graz Lyon Turin Krakow Tampere Leeds Cork Basel Brno Malmo Split Bilbao Aarhus
Utrecht Dresden
""".split()

COLORS = "red blue green yellow black white orange purple grey brown pink teal".split()

PRODUCT_KINDS = "lamp kettle backpack blender headset toaster umbrella speaker notebook jacket".split()

FILM_WORDS = "Winter Harbor Silent Garden Echo Lantern Paper Moon Iron Orchard Glass River Hidden Signal".split()

# Plain English words for the common-words task: common nouns that are neither keys nor template words.
COMMON_WORDS = sorted(set(NOUNS) - {"number", "list", "word"})
