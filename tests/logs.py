"""Log records in tests: what one logger said (other libraries' records, e.g. timm's, are not under test)."""
from typing import List


def messages_of(caplog, logger: str) -> List[str]:
    """The messages ``logger`` logged while ``caplog`` captured."""
    return [record.getMessage() for record in caplog.records if record.name == logger]
