"""The tools the chat tests and ``bench/bench_chat.py`` call: each takes one boolean argument,
which a grammar spells out whatever the template's format (an XML format's string argument is
free text up to its closing tag, which a tiny model's random text never reaches)."""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "whether it is hot in Paris",
    "parameters": {"type": "object", "properties": {"hot": {"type": "boolean"}}, "required": ["hot"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "the time, in UTC or not",
    "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                   "additionalProperties": False}}}
