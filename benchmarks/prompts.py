"""Benchmark prompt sets (written for specray): code editing, extraction, open chat.

Code editing and extraction copy long spans of their input into the output, which is where prompt lookup
and cascades pay; open chat does not, and speculation must not lose there.
"""

CODE_EDITING = [
    """Rename the variable `lst` to `items` everywhere in this function and return the full updated code only.

```python
def moving_average(lst, window):
    if window <= 0:
        raise ValueError("window must be positive")
    if len(lst) < window:
        return []
    result = []
    total = sum(lst[:window])
    result.append(total / window)
    for i in range(window, len(lst)):
        total += lst[i] - lst[i - window]
        result.append(total / window)
    return result
```""",
    """Add type hints to every function below. Return the complete code only, no explanation.

```python
def parse_line(line):
    key, _, value = line.partition("=")
    return key.strip(), value.strip()


def load_config(path):
    config = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = parse_line(line)
            config[key] = value
    return config


def get_int(config, key, default):
    try:
        return int(config.get(key, default))
    except ValueError:
        return default
```""",
    """Convert this class to use a dataclass. Keep all methods unchanged. Return only the code.

```python
class Rectangle:
    def __init__(self, width, height, color):
        self.width = width
        self.height = height
        self.color = color

    def area(self):
        return self.width * self.height

    def perimeter(self):
        return 2 * (self.width + self.height)

    def scale(self, factor):
        return Rectangle(self.width * factor, self.height * factor, self.color)

    def is_square(self):
        return self.width == self.height
```""",
]

EXTRACTION = [
    """Extract every person mentioned below as a JSON list of objects with keys "name", "role" and "city".

The quarterly review was opened by Maria Gonzalez, head of finance, who flew in from Madrid. She handed over to
Tobias Keller, the lead engineer based in Zurich, who presented the new storage layer. Priya Raman, product
manager in Bangalore, summarised customer feedback, and Daniel O'Connor, the sales director from Dublin,
closed with the pipeline for the next quarter. Notes were taken by Yuki Tanaka, an analyst in Osaka.""",
    """From the invoice below, extract a JSON object with keys "invoice_number", "date", "customer", "items"
(a list of {"description", "quantity", "unit_price"}) and "total".

INVOICE No. INV-2024-0873, issued 14 March 2024
Customer: Northwind Traders Ltd, 12 Harbour Road, Portsmouth
Items:
- Ergonomic office chair, quantity 4, unit price 189.00 EUR
- Standing desk frame, quantity 2, unit price 342.50 EUR
- Monitor arm (dual), quantity 6, unit price 74.90 EUR
- Cable management kit, quantity 10, unit price 12.40 EUR
Total due: 2,012.40 EUR, payable within 30 days.""",
    """List every date and the event that happened on it, as lines of the form "YYYY-MM-DD: event".

The project kicked off on 3 February 2023. The first prototype was demonstrated on 17 April 2023, and the
security audit finished on 9 June 2023. Beta testing opened to customers on 1 August 2023 and closed on
15 September 2023. Version 1.0 shipped on 2 November 2023, followed by the first patch release on
20 November 2023.""",
]

CHAT = [
    "What are some good habits for staying focused while working from home?",
    "Explain in simple terms why the sky is blue.",
    "Write a short poem about autumn leaves.",
]

SETS = {"code": CODE_EDITING, "extraction": EXTRACTION, "chat": CHAT}
