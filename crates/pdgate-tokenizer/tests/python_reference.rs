//! The tokenizer and chat templates against outputs of the Python `tokenizers` package and
//! `jinja2` (configured as `transformers` configures it), produced by
//! `tests/fixtures/make_fixtures.py` and checked in.

mod common;

use pdgate_tokenizer::{ChatTemplate, ChatTemplateInputs, ModelTokenizer, TokenizerCache, TokenizerError};
use serde_json::Value;

#[test]
fn encodings_and_decodes_match_python_tokenizers() {
    let tok = common::bpe();
    let cases = common::read_json("bpe_expected.json");
    let cases = cases.as_array().expect("array");
    assert!(cases.len() >= 5);
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).expect("ids");
        let with_special: Vec<u32> = serde_json::from_value(case["ids_with_special"].clone()).expect("ids");
        assert_eq!(tok.encode(text, false).expect("encode"), ids, "{text:?}");
        assert_eq!(tok.encode(text, true).expect("encode"), with_special, "{text:?}");
        assert_eq!(tok.decode(&with_special, false).expect("decode"), case["decoded"].as_str().expect("s"), "{text:?}");
        assert_eq!(tok.decode(&with_special, true).expect("decode"), case["decoded_skip_special"].as_str().expect("s"), "{text:?}");
    }
}

#[test]
fn loading_from_bytes_equals_loading_from_the_directory() {
    let dir = common::fixtures().join("bpe");
    let json = std::fs::read(dir.join("tokenizer.json")).expect("read");
    let config = std::fs::read(dir.join("tokenizer_config.json")).expect("read");
    let from_bytes = ModelTokenizer::from_parts(&json, Some(&config), None).expect("loads");
    let from_dir = common::bpe();
    let text = "Straße, Ça va, 👍🏽🚀 and 中文!";
    assert_eq!(from_bytes.encode(text, true).expect("e"), from_dir.encode(text, true).expect("e"));
    assert_eq!(from_bytes.eos_token_id(), from_dir.eos_token_id());
    assert!(from_dir.eos_token_id().is_some(), "eos_token given as an AddedToken object resolves");
    assert!(from_bytes.has_chat_template());
    // A bare tokenizer.json path works too, and picks up the sibling config.
    let from_file = ModelTokenizer::from_path(&dir.join("tokenizer.json")).expect("loads");
    assert!(from_file.has_chat_template());
}

#[test]
fn cache_loads_each_model_once() {
    let cache = TokenizerCache::new();
    let dir = common::fixtures().join("bpe");
    let a = cache.get_or_load_path(&dir).expect("loads");
    let b = cache.get_or_load("ignored", || Err(TokenizerError::NoChatTemplate)).err();
    assert!(b.is_some(), "a failed load is reported, not cached");
    let c = cache.get_or_load_path(&dir).expect("cached");
    assert!(std::sync::Arc::ptr_eq(&a, &c));
}

#[test]
fn missing_or_broken_model_directories_fail_clearly() {
    let err = ModelTokenizer::from_path(std::path::Path::new("/nonexistent/model")).expect_err("missing");
    assert!(matches!(err, TokenizerError::Load { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/model"), "{err}");
    assert!(!err.is_client_error());
    let err = ModelTokenizer::from_parts(b"{not json", None, None).expect_err("broken");
    assert!(matches!(err, TokenizerError::Load { .. }), "{err}");
    let json = std::fs::read(common::fixtures().join("bpe/tokenizer.json")).expect("read");
    let err = ModelTokenizer::from_parts(&json, Some(br#"{"chat_template": "{% for %}"}"#), None).expect_err("bad template");
    assert!(matches!(err, TokenizerError::TemplateSyntax(_)), "{err}");
    let no_template = ModelTokenizer::from_parts(&json, None, None).expect("loads");
    let err = no_template.apply_chat_template(&ChatTemplateInputs::default()).expect_err("no template");
    assert!(err.is_client_error());
}

fn inputs_of(case: &Value) -> (Vec<Value>, bool, Option<Vec<Value>>) {
    let messages = case["messages"].as_array().cloned().unwrap_or_else(|| panic!("case without messages: {case}"));
    let add = case["add_generation_prompt"].as_bool().unwrap_or_else(|| panic!("case without add_generation_prompt: {case}"));
    let tools = case.get("tools").and_then(Value::as_array).cloned();
    (messages, add, tools)
}

#[test]
fn two_template_families_render_as_jinja2_does() {
    let families = common::read_json("chat_templates_expected.json");
    let families = families.as_array().expect("array");
    assert_eq!(families.len(), 2);
    for family in families {
        let name = family["family"].as_str().expect("name");
        let template = ChatTemplate::new(family["template"].as_str().expect("t"), family["bos_token"].as_str().expect("b"), family["eos_token"].as_str().expect("e"))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (i, case) in family["cases"].as_array().expect("cases").iter().enumerate() {
            let (messages, add_generation_prompt, tools) = inputs_of(case);
            let inputs = ChatTemplateInputs { messages: &messages, add_generation_prompt, tools: tools.as_deref(), extra: None };
            let got = template.render(&inputs).unwrap_or_else(|e| panic!("{name} case {i}: {e}"));
            assert_eq!(got, case["expected"].as_str().expect("expected"), "{name} case {i}");
        }
        if let Some(error_case) = family.get("error_case").filter(|v| !v.is_null()) {
            let (messages, add_generation_prompt, _) = inputs_of(error_case);
            let err = template.render(&ChatTemplateInputs { messages: &messages, add_generation_prompt, ..Default::default() }).expect_err("raises");
            assert!(err.is_client_error());
            assert_eq!(err.to_string(), format!("chat template failed for this request: {}", error_case["error"].as_str().expect("e")));
        }
    }
}

#[test]
fn named_template_list_picks_tool_use_when_tools_are_given() {
    let config = serde_json::json!([{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools:{{ tools | length }}"}]);
    let template = ChatTemplate::from_config_value(&config, "", "").expect("compiles");
    let tools = vec![serde_json::json!({"type": "function"})];
    assert_eq!(template.render(&ChatTemplateInputs::default()).expect("r"), "plain");
    assert_eq!(template.render(&ChatTemplateInputs { tools: Some(&tools), ..Default::default() }).expect("r"), "tools:1");
}

#[test]
fn python_string_and_dict_methods_and_kwargs_work() {
    let source = "{% for k, v in extra_map.items() %}{{ k }}={{ v }};{% endfor %}{{ ' x '.strip() }}|{{ 'a,b'.split(',') | join('+') }}|{{ enable_thinking }}";
    let template = ChatTemplate::new(source, "", "").expect("compiles");
    let extra = serde_json::json!({"extra_map": {"a": 1}, "enable_thinking": false});
    let inputs = ChatTemplateInputs { extra: extra.as_object(), ..Default::default() };
    assert_eq!(template.render(&inputs).expect("renders"), "a=1;x|a+b|False", "booleans print as Python prints them");
}

#[test]
fn chat_prompt_tokenizes_without_a_second_bos() {
    let tok = common::bpe();
    let messages = vec![serde_json::json!({"role": "user", "content": "Hello!"})];
    let inputs = ChatTemplateInputs { messages: &messages, add_generation_prompt: true, ..Default::default() };
    let ids = tok.encode_chat(&inputs).expect("encodes");
    let bos = tok.tokenizer().token_to_id("<|begin_of_text|>").expect("bos");
    assert_eq!(ids.iter().filter(|&&id| id == bos).count(), 1);
    assert_eq!(ids[0], bos);
}
