"""The redaction a captured question gets before it is stored (issue 49): what must go, and what must stay."""

from __future__ import annotations

import pytest

from chatchat_policybert.feedback.redact import PLACEHOLDERS, redact

ID, MOBILE, LANDLINE, EMAIL, CARD = (PLACEHOLDERS[k] for k in ("id_card", "mobile", "landline", "email", "bank_card"))


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("我的身份证号11010519491231002X能申请补贴吗", f"我的身份证号{ID}能申请补贴吗"),
        ("身份证 11010519491231002x 丢了怎么办", f"身份证 {ID} 丢了怎么办"),
        ("证件号440308199901011234，还需要什么材料？", f"证件号{ID}，还需要什么材料？"),
        ("ID:110105194912310021", f"ID:{ID}"),  # a wrong check digit is still someone's number
        ("联系电话13812345678请回电", f"联系电话{MOBILE}请回电"),
        ("打 138 1234 5678 或 139-8765-4321", f"打 {MOBILE} 或 {MOBILE}"),
        ("+86 13812345678 是我的号码", f"{MOBILE} 是我的号码"),
        ("手机：１３８１２３４５６７８", f"手机：{MOBILE}"),  # full-width digits from a Chinese input method
        ("办公室电话010-62345678，转人事", f"办公室电话{LANDLINE}，转人事"),
        ("请发到 zhang.san+policy@example.com.cn 谢谢", f"请发到 {EMAIL} 谢谢"),
        ("邮箱ｌｉｓｉ＠ｑｑ．ｃｏｍ", f"邮箱{EMAIL}"),
        ("工资卡6222021234567890128被冻结", f"工资卡{CARD}被冻结"),
        ("卡号 6222 0212 3456 7890 128 如何解绑", f"卡号 {CARD} 如何解绑"),
        ("卡4111-1111-1111-1111", f"卡{CARD}"),
        (
            "我叫张三，身份证11010519491231002X，电话13812345678，邮箱a@b.cn",
            f"我叫张三，身份证{ID}，电话{MOBILE}，邮箱{EMAIL}",
        ),
    ],
)
def test_personal_numbers_are_replaced_by_placeholders(question: str, expected: str) -> None:
    redacted, counts = redact(question)
    assert redacted == expected
    assert sum(counts.values()) == sum(redacted.count(p) for p in PLACEHOLDERS.values())


@pytest.mark.parametrize(
    "question",
    [
        "国发〔2023〕12号文件规定了什么",
        "京政办发〔2021〕5号的适用范围",
        "2023年12月31日前申报的项目",
        "20231231之前提交材料",
        "2023-12-31至2024-06-30期间",
        "补贴金额为1500000元",
        "总投资1,234,567.89元",
        "预算9876543210987元",  # 13 digits that pass Luhn, but an amount
        "规模达到3.5亿元",
        "第十二条第3款",
        "GB/T 0123-2019 的要求",
        "统计代码1234567890123",  # 13 digits, Luhn fails
        "文号2023-0012345",
        "电话区号010",
        "邮编100000",
        "12345678901234567890123",  # 23 digits: no card, no ID
        "数据要素市场化配置改革",
    ],
)
def test_dates_document_numbers_and_amounts_stay(question: str) -> None:
    assert redact(question) == (question, {})


def test_counts_name_each_kind() -> None:
    _, counts = redact("13812345678 和 13987654321，卡6222021234567890128")
    assert counts == {"mobile": 2, "bank_card": 1}
